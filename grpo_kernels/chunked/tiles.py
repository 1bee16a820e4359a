"""What the chunked launchers (`linear_launchers.py`, `logits_launchers.py`) do to one tile of
logits: the softmax statistics, the per-token results, the backward's tile of d z (and its
modes: how the linear-head backward makes that tile, `BackwardMode`), and the tile's operands.

Every exponential over a tile is a base-2 one: PyTorch's CPU exp2 kernel takes about a third of
the time of its exp (0.37 against 1.2 ms for 1M float32 on one core of an AMD EPYC, torch 2.13),
and exp is the costliest pass over a tile after the GEMMs. The factor log2(e) rides in what is
scaled anyway (hidden × log2(e)/τ before the GEMM, logits × log2(e)/τ in the pass that shifts
them), so a tile holds its logits in log2 units at no extra pass, and only per-token [N] values
are converted to nats.
The sum s = Σ 2^(z-m) over log2-unit logits is the same number as Σ e^(z'-m') in nats.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .blocks import row_parts

LOG2E = 1.0 / math.log(2.0)  # e^x = 2^(x·LOG2E)
LN2 = math.log(2.0)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs accumulate in float32)."""
    dtypes = [t.dtype for t in tensors if t is not None]
    return torch.float64 if torch.float64 in dtypes else torch.float32


def empty_stats(N, device):
    """(logp, entropy, lse): float32 [N] each, for the launchers to fill."""
    return tuple(torch.empty(N, device=device, dtype=torch.float32) for _ in range(3))


def view(buf, r, c):
    """The first r·c elements of a flat buffer as [r, c] (None stays None)."""
    if buf is None:
        return None
    return buf.view(r, c) if buf.numel() == r * c else buf[:r * c].view(r, c)


def exp_sums(z, scratch):
    """z [..., c] (log2 units, <= 0) -> (Σ 2^z, Σ 2^z·z) over the last dim; scratch [..., c]
    receives 2^z."""
    e = torch.exp2(z, out=scratch)
    return e.sum(dim=-1), e.mul_(z).sum(dim=-1)


def tile_update(z, scratch, m, s, t, first: bool) -> None:
    """Online softmax over one tile of logits in log2 units. z [r, c] (consumed), scratch [r, c];
    state [r] each: m = running max, s = Σ 2^(z-m), t = Σ 2^(z-m)·(z-m), relative to the
    current m."""
    tile_max = z.amax(dim=1)
    m_new = tile_max if first else torch.maximum(m, tile_max)
    z.sub_(m_new[:, None])  # z - m_new <= 0
    tile_s, tile_t = exp_sums(z, scratch)
    if first:
        m.copy_(m_new), s.copy_(tile_s), t.copy_(tile_t)
        return
    shift = m - m_new  # <= 0: move the old sums to the new max
    alpha = shift.exp2()
    t.add_(shift * s).mul_(alpha).add_(tile_t)
    s.mul_(alpha).add_(tile_s)
    m.copy_(m_new)


def finish_stats(m, s, t, picked, out) -> None:
    """Per-token results from log2-unit statistics (m, s, t as in `tile_update`, picked =
    z_target - m; [r] each, consumed): lse = ln2·m + ln s; entropy = ln s - ln2·t/s (no
    cancellation for peaked rows); logp = ln2·picked - ln s. Written into out = (logp, entropy,
    lse), float32 [r] each: directly when the statistics are float32 (one op each)."""
    t.div_(s)
    log_s = torch.xlogy(1.0, s)  # ln s: torch.log of even 128 values forks threads (MKL VML)
    direct = out[0].dtype == log_s.dtype
    results = (torch.mul(picked, LN2, out=out[0] if direct else None).sub_(log_s),
               torch.add(log_s, t, alpha=-LN2, out=out[1] if direct else None),
               torch.add(log_s, m, alpha=LN2, out=out[2] if direct else None))
    if not direct:  # float64 statistics, float32 results
        for o, x in zip(out, results):
            o.copy_(x)


def neg_dz_tile(logp, scratch, ent, g, gh):
    """logp [r, c] (log2 p of the tile; overwritten) -> -d z without the one-hot term, for
    Σ g·logp + Σ g_H·H: p·(g + g_H·(ln p + H)). g [r, 1]; ent = H·log2(e) and gh = g_H·ln 2
    ([r, 1]; gh may be None), so that gh·(log2 p + ent) = g_H·(ln p + H)."""
    if gh is None:
        return logp.exp2_().mul_(g)
    p = torch.exp2(logp, out=scratch)
    return torch.addcmul(g, gh, logp.add_(ent), out=logp).mul_(p)


def log2_head(hidden, bias, dtype, temperature, alpha=None):
    """(hidden [N, D] and bias [V] | None in the compute dtype, alpha = log2(e)/τ), so that
    z = alpha·(h @ W^T) + b is the logits in log2 units: the GEMM applies alpha, so hidden is
    never scaled (the bias is, [V]). A given alpha replaces log2(e)/τ (a soft cap's s/c)."""
    alpha = LOG2E / temperature if alpha is None else alpha
    return hidden.to(dtype), None if bias is None else bias.to(dtype) * alpha, alpha


class Cap(NamedTuple):
    """A linear-head forward tile with a cap: z/τ in log2 units = post·tanh(pre·y)."""

    pre: float  # s/c
    post: float  # c·log2(e)/τ


def head_transform(temperature: float, softcap, logit_scale) -> tuple[float, Cap | None]:
    """(temperature for the linear-head launchers, Cap or None). A scale alone is a temperature:
    s·y / τ = y / (τ/s) (also for s < 0: every step of the linear head's launchers takes the sign
    of 1/τ through, and its maxima are taken after the scaling); a cap needs the tanh."""
    s = 1.0 if logit_scale is None else float(logit_scale)
    if softcap is None:
        return temperature / s, None
    return temperature, Cap(pre=s / softcap, post=softcap * LOG2E / temperature)


def cap_tile_(y, cap: Cap):
    """In place: a tile of pre·y (the GEMM applied pre) -> post·tanh(pre·y), log2 units."""
    return y.tanh_().mul_(cap.post)


def gemm_into(acc, a, b, first: bool, alpha: float = 1.0) -> None:
    """acc = alpha·(a @ b) when `first` (acc's old values ignored), else acc += alpha·(a @ b)."""
    torch.addmm(acc, a, b, beta=0.0 if first else 1.0, alpha=alpha, out=acc)


def logits_tile(h, w, b, out, alpha):
    """out [r, c] = alpha·(h [r, D] @ w [c, D]^T) (+ b [c]); out's old values are ignored."""
    return torch.addmm(out if b is None else b, h, w.T, beta=0.0 if b is None else 1.0,
                       alpha=alpha, out=out)


def weight_tile(weight, v0, cols, dtype, buf):
    """weight[v0:v0 + cols] in the compute dtype: the weight itself or a view when it already
    is, else copied into `buf` (one buffer reused by every vocabulary tile of the call)."""
    w = weight if v0 == 0 and cols >= weight.shape[0] else weight[v0:v0 + cols]
    if w.dtype == dtype:
        return w
    return buf[:w.numel()].view(w.shape).copy_(w)


def tile_buffer(weight, dtype, cols):
    """The buffer `weight_tile` copies half weights into (None when no copy is needed)."""
    if weight.dtype == dtype:
        return None
    return torch.empty(min(cols, weight.shape[0]) * weight.shape[1], dtype=dtype,
                       device=weight.device)


def in_tile(targets, v0, c):
    """Column of each token's target in the tile [v0, v0 + c) (clamped), and whether it is there:
    [r] each. Lets one small gather/scatter per tile touch the target column."""
    col = targets - v0
    inside = (col >= 0) & (col < c)
    return col.clamp_(0, c - 1)[:, None], inside


# ---- the backward's modes: how a tile of logits becomes x, d z = σ·x ----------------------------


class BackwardMode(NamedTuple):
    """How the backward turns tiles of logits into x, d z = σ·x per token, and what the two
    gradient GEMMs take. Per-token values cover the Na active tokens."""

    buffers: int  # [rows, cols] buffers per tile, for its shape: 1, or 2 (p's scratch)
    scratch: bool  # whether `finish` needs that second buffer (an entropy gradient)
    shift: torch.Tensor  # [Na, 1], added to a tile (z, or the kept z - m): gives log2 p
    finish: Callable  # (shifted tile [r, c], scratch [r, c] | None, part) -> x, in place
    tile: Callable  # (buffer [r, c], part, w [c, D], bias tile [c] | None, scratch) -> x
    one_hot: torch.Tensor  # [Na]: the target's term of x (scattered after `tile`)
    target_x: torch.Tensor | None  # [Na]: the target column's x, written over the tile's
    h_dw: torch.Tensor | None  # [Na, D]: d W_tile = alpha_dw·x^T @ h_dw
    alpha_dh: float  # d hidden = alpha_dh·x @ W_tile (summed over tiles)
    alpha_dw: float
    dh_scale: torch.Tensor | None  # [Na, 1]: applied to d hidden once, after the tiles


def fast_mode(h, g, offset, inv_t, alpha, want_dw, logp=None, sums=None) -> BackwardMode:
    """No bias, no entropy gradient: x = 2^(z + offset) - onehot = p - onehot, σ = -g/τ, with
    z = α·h W^T in log2 units (α = log2(e)/τ) and offset = log2 p - z per token (`row_offset`).
    Without sums the offset rides in the GEMM's bias, so a tile is one addmm, one exp2_, one
    small scatter and the two gradient GEMMs, in one buffer; σ goes onto hidden (for d W) and
    onto d hidden at the end, not into the exponent: log2|g| there would round p at
    ulp(log2|g|), which the one-hot's cancellation (1 - p of a dominant token) would show.
    h [Na, D]; g, offset [Na]; logp [Na] or None: the forward's log-probs, `target_column`.

    sums [Na] or None: the forward's S (`reference_sums`), offset = -r: the tile holds
    2^(z - r) = S·p, so x = S·(p - onehot) (the one-hot's term is -S, the target column's
    S·(p - 1)) and σ/S goes where σ went: no pass over the tile for 1/S. z - r is then taken
    after the GEMM (`exact_tile`), not in its bias."""
    row_shift = offset[:, None]  # [Na, 1]
    sigma = g * -inv_t
    dh_scale = (sigma if sums is None else sigma / sums)[:, None]  # σ (σ/S)
    h_dw = h * dh_scale if want_dw else None
    one_hot = torch.full_like(g, -1.0) if sums is None else -sums  # the one-hot's term of x
    target_x = target_column(logp, None, None, None)
    if target_x is not None and sums is not None:
        target_x = target_x * sums

    def finish(x, scratch, part):
        return x.exp2_()

    def tile(z, part, w, bt, scratch):  # bt is None: no bias in this mode
        if sums is not None:
            return exact_tile(part(h), w, None, z, alpha, part(row_shift)).exp2_()
        return torch.addmm(part(row_shift), part(h), w.T, alpha=alpha, out=z).exp2_()

    return BackwardMode(buffers=1, scratch=False, shift=row_shift, finish=finish, tile=tile,
                        one_hot=one_hot, target_x=target_x,
                        h_dw=h_dw, alpha_dh=1.0, alpha_dw=1.0, dh_scale=dh_scale)


def general_mode(h, g, gh, offset, ent, inv_t, alpha, logp=None, sums=None) -> BackwardMode:
    """A bias or an entropy gradient: x = p·(g + g_H·(ln p + H)) - g·onehot and σ = -1, which
    goes with 1/τ into the GEMMs' alpha. h [Na, D]; g, offset [Na] (log2 p - z, `row_offset`);
    gh, ent [Na] or None; logp [Na] or None: the forward's log-probs, `target_column`.

    sums [Na] or None: the forward's S (`reference_sums`), offset = -r: the shifted tile holds
    log2(S·p), and 2^(it) = S·p; with g/S and g_H/S as the per-token factors and
    H·log2(e) - log2 S for the entropy's, x comes out as above without a pass for 1/S."""
    row_shift = offset[:, None]  # without a bias: log2 p straight from addmm
    inv_s = None if sums is None else 1.0 / sums
    g_c = (g if sums is None else g * inv_s)[:, None]
    gh_c = None if gh is None else (gh * LN2 if sums is None else gh * LN2 * inv_s)[:, None]
    ent_c = None
    if gh is not None:
        ent_c = ent * LOG2E if sums is None else ent * LOG2E - torch.xlogy(LOG2E, sums)
        ent_c = ent_c[:, None]

    def finish(x, scratch, part):
        return neg_dz_tile(x, scratch, None if gh is None else part(ent_c), part(g_c),
                           None if gh is None else part(gh_c))

    def tile(z, part, w, bt, scratch):
        if bt is None and sums is None:
            x = torch.addmm(part(row_shift), part(h), w.T, alpha=alpha, out=z)
        else:
            x = exact_tile(part(h), w, bt, z, alpha, part(row_shift))
        return finish(x, scratch, part)

    return BackwardMode(buffers=2, scratch=gh is not None, shift=row_shift, finish=finish,
                        tile=tile, one_hot=-g, target_x=target_column(logp, g, gh, ent),
                        h_dw=h, alpha_dh=-inv_t, alpha_dw=-inv_t, dh_scale=None)


def exact_tile(h, w, b, out, alpha, shift):
    """out [r, c] = the forward's logits tile (`logits_tile`, the same GEMM: the same bits)
    plus shift [r, 1], added after the GEMM: z - r is then exact where z is near r (a dominant
    token's column). In the GEMM's bias the shift would join the sum over D blocks at its
    start (MKL accumulates a blocked product into its output), and z - r there differs from
    the forward's by the rounding of z (2e-6 at |z| ≈ 40 nats)."""
    return logits_tile(h, w, b, out, alpha).add_(shift)


def target_column(logp, g, gh, ent):
    """The target column's x [Na] from the forward's log-probs logp [Na] (None: none, the
    tile's value and the one-hot term are used). Without g (`fast_mode`): x = p - 1; else
    (`general_mode`): x = p·(g + g_H·(ln p + H)) - g, gh and ent [Na] or None.

    A recomputed tile reads p through the lse in nats (`row_offset`), whose float32 rounding
    (2e-6 at |lse| ≈ 40) would show in 1 - p of a dominant target, a cancellation; the forward's
    logp of such a row is -ln s, with float32's relative precision, and expm1 keeps it. The
    recomputed logits (a GEMM blocked unlike the forward's) cannot give the same: only the
    forward's own numbers agree with each other to that precision."""
    if logp is None:
        return None
    p_1 = torch.expm1(logp)  # p - 1 (torch.exp of even 128 values forks threads, expm1 not)
    if g is None:
        return p_1
    x = p_1 * g
    if gh is not None:  # + g_H·p·(ln p + H)
        x.addcmul_(p_1.add_(1.0).mul_(gh), logp + ent)
    return x


def add_target_term(x, col, inside, one_hot, target_x) -> None:
    """The target column of a tile x [r, c]: the one-hot term one_hot [r] added, or target_x
    [r] (a `BackwardMode`'s, when not None) written over it. col [r, 1]: each row's target
    column in the tile; inside [r] bool: whether the target is in it (None: every target is)."""
    if target_x is None:
        term = one_hot if inside is None else one_hot * inside
        x.scatter_add_(1, col, term[:, None])
        return
    value = target_x
    if inside is not None:  # rows whose target is in another tile keep the tile's value
        value = torch.where(inside, value, x.gather(1, col).squeeze(1))
    x.scatter_(1, col, value[:, None])


def row_offset(lse, kept, pick, lse_sum=None):
    """(offset, sums): offset [Na] = log2 p - (what a backward tile holds), or log2(S·p) - it
    with sums [Na] = S, per active token, log2 units (sums None: S = 1).

    The forward's kept tile holds z - m: offset = -log2 s, the forward's own [N] value
    (kept["log_sum"]). A tile recomputed from the head holds z: offset = -r, r = lse·log2(e)
    from the nats lse [N], rounded at |lse| (2e-6 at |lse| ≈ 40): 2^(z - r) is p to that
    relative error, which a dominant token's d z = g·p (target or not) would carry. The
    forward's lse_sum [N] (`reference_sums`) is S = Σ 2^(z - r) over its own z and this same r,
    so 2^(z - r) / S is p to float32's precision: at the dominant token, z - r is the forward's
    m - r exactly when the backward's GEMM gives the forward's z (`exact_tile`), and
    2^(m - r) / S = 1 / s."""
    if kept:
        return -pick(kept.pop("log_sum")), None
    return neg_lse_reference(pick(lse)), pick(lse_sum)


def neg_lse_reference(lse):
    """-r = -lse·log2(e) [n] in lse's dtype: the reference a recomputing backward reads p
    against (`row_offset`), and that `reference_sums` forms S against, bit for bit; a
    vocabulary shard's statistics are combined against it too (grpo_kernels/parallel)."""
    return lse * -LOG2E


def reference_sums(m, s, lse):
    """S = Σ 2^(z - r) over each row, r = lse·log2(e) as the backward's `row_offset` forms it,
    from the forward's m and s = Σ 2^(z - m) (log2 units; lse the float32 nats output):
    S = s·2^(m - r), with m - r rounded as the backward's tile rounds z - r at z = m (one
    float32 subtraction, exact near the maximum). m, s, lse and S: [n] each."""
    neg_r = neg_lse_reference(lse.to(m.dtype))  # the backward's offset, bit for bit
    return torch.exp2(neg_r.add_(m)).mul_(s)


def tile_sums(weight, h, b, neg_r, alpha, rows, cols):
    """S [Na] = Σ 2^(z - r) over each row of the logits z that a recomputing linear-head backward
    forms itself: in its own [rows, cols] tiles, each GEMM as its tile pass runs it
    (`exact_tile`: the same bits), so that 2^(z - r) / S is p to float32's precision at every
    column, a dominant one included, however the forward's GEMM rounded its logits. One more
    GEMM pass over the vocabulary. weight [V, D]; h [Na, D] and b [V] | None as `log2_head`
    gives them (compute dtype); neg_r [Na] = -r (`row_offset`)."""
    Na, V, dtype = h.shape[0], weight.shape[0], h.dtype
    sums = torch.zeros(Na, dtype=dtype, device=h.device)
    z_buf = torch.empty(min(rows, Na) * min(cols, V), dtype=dtype, device=h.device)
    w_buf = tile_buffer(weight, dtype, cols)
    for v0 in range(0, V, cols):
        w = weight_tile(weight, v0, cols, dtype, w_buf)  # [c, D]
        c = w.shape[0]
        bt = b if b is None or c == V else b[v0:v0 + c]
        for _, r, part in row_parts(Na, rows):
            z = exact_tile(part(h), w, bt, view(z_buf, r, c), alpha, part(neg_r)[:, None])
            part(sums).add_(z.exp2_().sum(dim=1))
    return sums


def kept_mode(mode: BackwardMode, kept: dict, idx) -> tuple[BackwardMode, torch.Tensor]:
    """`mode` (made with the kept tile's `row_offset`) started from the forward's kept tile
    z - m [N, V] (log2 units, bias included), taken out of `kept`: its active rows [Na, V] are
    the one tile and its buffer, shifted by `mode.shift` to log2 p and finished as `mode` does;
    no GEMM. Returns (the mode, the tile)."""
    kept_z = kept.pop("tile")
    kept_z = kept_z if idx is None else kept_z.index_select(0, idx)

    def tile(z, part, w, bt, scratch):  # z: kept_z itself (one tile, one block of all rows)
        return mode.finish(z.add_(mode.shift), scratch, part)

    return mode._replace(tile=tile), kept_z
