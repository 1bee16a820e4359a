"""What the chunked launchers (`chunked.py`) do to one tile of logits: the softmax statistics,
the per-token results, the backward's tile of d z, and the tile's operands.

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

import torch

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


def log2_head(hidden, bias, dtype, temperature):
    """(hidden [N, D] and bias [V] | None in the compute dtype, alpha = log2(e)/τ), so that
    z = alpha·(h @ W^T) + b is the logits in log2 units: the GEMM applies alpha, so hidden is
    never scaled (the bias is, [V])."""
    alpha = LOG2E / temperature
    return hidden.to(dtype), None if bias is None else bias.to(dtype) * alpha, alpha


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
