"""Chunked PyTorch path for CPUs without the Triton interpreter.

Same contract as the Triton launchers in `kernels/linear_logprobs.py` and
`kernels/logits_logprobs.py`: selective log-prob and entropy, and their backward, from per-token
statistics only (lse and entropy are saved, logits never are). The trainer uses it on a laptop.

Linear head: the logits z = (hidden @ weight.T + bias) / τ are produced one [rows, cols] tile at a
time (vocabulary tiles outer, token blocks inner), so at most two tiles of float32 exist at once
and each weight tile is read from memory once per pass:
- forward keeps an online softmax per token (running max m, Σ e^(z-m) and Σ e^(z-m)·(z-m)), so
  lse and the entropy come out of one pass over the vocabulary;
- backward recomputes each tile, turns it into d z in place and feeds it straight to the two
  GEMMs (d hidden += d z @ W_tile, d W_tile += d z^T @ hidden). Tokens with no gradient (padding)
  are dropped before the tiles, and the target's one-hot term is added outside them.
Logits always accumulate in float32 (float64 for float64 inputs), whatever the input dtype: half
operands are upcast a tile at a time (and hidden once, [N, D]), never the whole [V, D] weight.
Scratch buffers are allocated once per call, not per tile, and sized to the problem (a logits
tile never has more elements than N·V); nothing is zero-filled that a GEMM or a copy overwrites.
Each op over a whole tile is a parallel region, and on a shared CPU each region can wait for a
core, so the passes over a tile are kept few, and small per-token work uses ops that stay on the
calling thread (index_select, not advanced indexing, which forks threads at any size).
A float32 weight with bf16/fp16 hidden (mixed head precision) gives the fp32 head's logits of the
hidden states as given; each gradient comes back in its input's dtype.
"""

from __future__ import annotations

import functools

import torch

# Logits input: elements of one [rows, V] float32 block (one buffer; two with an entropy
# gradient): 16 MiB.
CHUNK_ELEMENTS = 2**22
# Linear head: at least TILE_ROWS tokens per tile (each weight tile is reused by that many tokens,
# enough for the GEMMs to stay compute-bound) and TILE_ELEMENTS per [rows, cols] float32 logits
# tile: 64 MiB, one buffer (two with an entropy gradient). Tiles are large on purpose: every
# elementwise op is one parallel region, and on a busy machine each region waits until all its
# threads get a core (tens of ms at a load of 10+ on 2 cores), so few large ops beat many small
# cache-sized ones there; on an idle machine the difference is small.
TILE_ROWS = 256
TILE_ELEMENTS = 2**24


def _chunk_rows(V: int, chunk_elements: int | None) -> int:
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(V, 1))


def _tile_shape(N: int, V: int, chunk_elements: int | None, buffers: int) -> tuple[int, int]:
    """(rows, cols) of a linear-head logits tile: `buffers` such tiles fit the element budget."""
    budget = max(1, (chunk_elements or TILE_ELEMENTS) // buffers)
    rows = max(1, min(N, max(TILE_ROWS, budget // max(V, 1))))  # whole rows when V is small
    cols = max(1, min(V, budget // rows))
    return rows, cols


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs accumulate in float32)."""
    dtypes = [t.dtype for t in tensors if t is not None]
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _empty_stats(N, device):
    return tuple(torch.empty(N, device=device, dtype=torch.float32) for _ in range(3))


def _view(buf, r, c):
    return None if buf is None else buf[:r * c].view(r, c)


def _tile_update(z, scratch, m, s, t, first: bool) -> None:
    """Online softmax over one tile. z [r, c] (consumed), scratch [r, c]; state [r] each:
    m = running max, s = Σ e^(z-m), t = Σ e^(z-m)·(z-m), all relative to the current m."""
    tile_max = z.amax(dim=1)
    m_new = tile_max if first else torch.maximum(m, tile_max)
    z.sub_(m_new[:, None])  # z - m_new <= 0
    e = torch.exp(z, out=scratch)
    tile_s = e.sum(dim=1)
    tile_t = e.mul_(z).sum(dim=1)
    if first:
        m.copy_(m_new), s.copy_(tile_s), t.copy_(tile_t)
        return
    shift = m - m_new  # <= 0: move the old sums to the new max
    alpha = shift.exp()
    t.add_(shift * s).mul_(alpha).add_(tile_t)
    s.mul_(alpha).add_(tile_s)
    m.copy_(m_new)


def _finish_stats(m, s, t, picked, out) -> None:
    """lse = m + log s; entropy = log s - E[z - m] (no cancellation for peaked rows);
    logp = z_target - lse. Written into out = (logp, entropy, lse), float32 [r] each."""
    log_s = s.log()
    lse = m + log_s
    out[0].copy_(picked - lse)
    out[1].copy_(log_s - t / s)
    out[2].copy_(lse)


def _scaled_hidden(hidden, dtype, inv_t):
    """hidden [N, D] in the compute dtype, times 1/τ (so z = h' @ W^T + b/τ); a copy only when
    needed (half hidden, or τ != 1)."""
    h = hidden.to(dtype)
    return h if inv_t == 1.0 else h * inv_t


def _logits_tile(h, w, b, out):
    """out [r, c] = h [r, D] @ w [c, D]^T (+ b [c])."""
    if b is None:
        return torch.mm(h, w.T, out=out)
    return torch.addmm(b, h, w.T, out=out)


def _weight_tile(weight, v0, cols, dtype, buf):
    """weight[v0:v0 + cols] in the compute dtype: a view when it already is, else copied into
    `buf` (one buffer reused by every vocabulary tile of the call)."""
    w = weight[v0:v0 + cols]
    if w.dtype == dtype:
        return w
    return buf[:w.numel()].view(w.shape).copy_(w)


def _tile_buffer(weight, dtype, cols):
    """The buffer `_weight_tile` copies half weights into (None when no copy is needed)."""
    if weight.dtype == dtype:
        return None
    return torch.empty(min(cols, weight.shape[0]) * weight.shape[1], dtype=dtype,
                       device=weight.device)


def _in_tile(targets, v0, c):
    """Column of each token's target in the tile [v0, v0 + c) (clamped), and whether it is there:
    [r] each. Lets one small gather/scatter per tile touch the target column."""
    col = targets - v0
    inside = (col >= 0) & (col < c)
    return col.clamp_(0, c - 1)[:, None], inside


def linear_logprob_forward(hidden, weight, bias, targets, temperature, chunk_elements=None):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N]
    -> float32 (logp, entropy, lse), each [N]."""
    N, V = hidden.shape[0], weight.shape[0]
    out = _empty_stats(N, hidden.device)
    if N == 0:
        return out
    dtype, inv_t = _compute_dtype(hidden, weight, bias), 1.0 / temperature
    rows, cols = _tile_shape(N, V, chunk_elements, buffers=2)
    with torch.no_grad():
        h = _scaled_hidden(hidden, dtype, inv_t)
        b = None if bias is None else bias.to(dtype) * inv_t
        m, s, t, picked = (torch.zeros(N, dtype=dtype, device=h.device) for _ in range(4))
        z_buf, e_buf = (torch.empty(rows * cols, dtype=dtype, device=h.device) for _ in range(2))
        w_buf = _tile_buffer(weight, dtype, cols)
        for v0 in range(0, V, cols):
            w = _weight_tile(weight, v0, cols, dtype, w_buf)  # [c, D]
            bt = None if b is None else b[v0:v0 + cols]
            c = w.shape[0]
            col, inside = _in_tile(targets, v0, c)
            for r0 in range(0, N, rows):
                sl = slice(r0, min(r0 + rows, N))
                r = sl.stop - r0
                z = _logits_tile(h[sl], w, bt, _view(z_buf, r, c))
                picked[sl] = torch.where(inside[sl], z.gather(1, col[sl]).squeeze(1), picked[sl])
                _tile_update(z, _view(e_buf, r, c), m[sl], s[sl], t[sl], first=v0 == 0)
        _finish_stats(m, s, t, picked, out)
    return out


def _neg_dz_tile(logp, scratch, ent, g, gh):
    """logp [r, c] (log p of the tile; overwritten) -> -d z without the one-hot term, for
    Σ g·logp + Σ gh·H:  p·(g + gh·(log p + H)); ent, g, gh [r, 1] (gh may be None)."""
    if gh is None:
        return logp.exp_().mul_(g)
    p = torch.exp(logp, out=scratch)
    return torch.addcmul(g, gh, logp.add_(ent), out=logp).mul_(p)


def _gemm_into(acc, a, b, first: bool, alpha: float = 1.0) -> None:
    """acc = alpha·(a @ b) when `first` (acc's old values are ignored, so it need not be
    zeroed), else acc += alpha·(a @ b)."""
    torch.addmm(acc, a, b, beta=0.0 if first else 1.0, alpha=alpha, out=acc)


def _active_rows(g, gh):
    """Indices of tokens with a non-zero gradient coefficient (None: all of them)."""
    busy = g != 0 if gh is None else (g != 0) | (gh != 0)
    if bool(busy.all()):
        return None
    return busy.nonzero().squeeze(1)


def linear_logprob_backward(
    hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature,
    needs=(True, True, True), chunk_elements=None, grad_filter=None,
):
    """Gradients of Σ g_logp·logp + Σ g_ent·H (see linear_logprobs.linear_logprob_backward).

    Always exact: gradient filtering (`grad_filter`) saves work only in the Triton atomic
    backward; here every tile is one dense matmul either way."""
    want_dh, want_dw = bool(needs[0]), bool(needs[1])
    want_db = bias is not None and bool(needs[2])
    idx = _active_rows(g_logp, g_ent)
    V = weight.shape[0]
    if (hidden.shape[0] == 0 or (idx is not None and idx.numel() == 0) or V == 0
            or not (want_dh or want_dw or want_db)):
        # no tokens, or masked tokens only: no work (and d W must be zeros, not left unwritten)
        return tuple(torch.zeros_like(x) if want else None
                     for x, want in ((hidden, want_dh), (weight, want_dw), (bias, want_db)))
    dtype, inv_t = _compute_dtype(hidden, weight, bias), 1.0 / temperature

    def pick(x):  # [N, ...] -> the active tokens' rows, in the compute dtype
        if x is None:
            return None
        x = x if idx is None else x.index_select(0, idx)  # advanced indexing would fork threads
        return x.to(dtype) if x.is_floating_point() else x

    with torch.no_grad():
        h = _scaled_hidden(pick(hidden), dtype, inv_t)  # [Na, D]
        tg, g, gh, lse_a, ent_a = (pick(x) for x in (targets, g_logp, g_ent, lse, ent))
        b = None if bias is None else bias.to(dtype) * inv_t
        Na, D = h.shape
        # Each tile is turned into x with d z = σ·x per token. Fast (no bias, no entropy
        # gradient): x = exp(z - lse + log|g|) - |g|·onehot and σ = -sign(g); the per-token
        # constants ride in the GEMM's input, so a tile is one addmm, one exp_, one small scatter
        # and the two gradient GEMMs, in one buffer; σ goes onto hidden (for d W) and onto d
        # hidden at the end. General: x = p·(g + g_H·(log p + H)) - g·onehot and σ = -1, which
        # goes into the GEMMs' alpha.
        fast = b is None and gh is None
        rows, cols = _tile_shape(Na, V, chunk_elements, buffers=1 if fast else 2)
        if fast:
            row_shift = (g.abs().log() - lse_a)[:, None]  # [Na, 1]; g != 0 on active rows
            neg_sign = -g.sign()
            h_dw = h * neg_sign[:, None] if want_dw else None
            one_hot = -g.abs()  # g·onehot in units of the tile (|d z| = -sign(g)·d z)
            alpha_dh, alpha_dw, dh_scale = 1.0, 1.0, (neg_sign * inv_t)[:, None]
        else:
            neg_lse = None if b is not None else (-lse_a)[:, None]  # log p straight from addmm
            cols_of = lambda x: None if x is None else x[:, None]  # noqa: E731
            g_c, gh_c, ent_c = cols_of(g), cols_of(gh), cols_of(ent_a)
            h_dw, one_hot = h, -g
            alpha_dh, alpha_dw, dh_scale = -inv_t, -1.0, None
        # d hidden accumulates over vocabulary tiles in the compute dtype: [Na, D]; the first
        # vocabulary tile writes it, so nothing is zeroed
        direct_dh = want_dh and idx is None and hidden.dtype == dtype
        dh_acc = None
        if want_dh:
            dh_acc = torch.empty_like(hidden) if direct_dh else torch.empty_like(h)
        dw = torch.empty_like(weight) if want_dw else None  # every vocabulary tile is written
        dw_buf = None
        if want_dw and weight.dtype != dtype:  # [c, D] of d W in the compute dtype
            dw_buf = torch.empty(min(cols, V) * D, dtype=dtype, device=h.device)
        db_acc = torch.zeros(V, dtype=dtype, device=h.device) if want_db else None
        z_buf = torch.empty(rows * cols, dtype=dtype, device=h.device)
        e_buf = None if gh is None else torch.empty_like(z_buf)  # p, for the entropy term
        w_buf = _tile_buffer(weight, dtype, cols)
        for v0 in range(0, V, cols):
            w = _weight_tile(weight, v0, cols, dtype, w_buf)  # [c, D]
            c = w.shape[0]
            bt = None if b is None else b[v0:v0 + c]
            col, inside = _in_tile(tg, v0, c)
            target_term = (one_hot * inside)[:, None]
            # d W of this tile accumulates over token blocks, then is written once
            dw_tile = None
            if want_dw:
                dw_tile = dw[v0:v0 + c] if dw.dtype == dtype else _view(dw_buf, c, D)
            for r0 in range(0, Na, rows):
                sl = slice(r0, min(r0 + rows, Na))
                r = sl.stop - r0
                z = _view(z_buf, r, c)
                if fast:
                    x = torch.addmm(row_shift[sl], h[sl], w.T, out=z).exp_()
                else:
                    if bt is None:
                        x = torch.addmm(neg_lse[sl], h[sl], w.T, out=z)
                    else:
                        x = torch.addmm(bt, h[sl], w.T, out=z).sub_(lse_a[sl, None])
                    x = _neg_dz_tile(x, _view(e_buf, r, c), None if gh is None else ent_c[sl],
                                     g_c[sl], None if gh is None else gh_c[sl])
                x.scatter_add_(1, col[sl], target_term[sl])
                if dh_acc is not None:
                    _gemm_into(dh_acc[sl], x, w, first=v0 == 0, alpha=alpha_dh)
                if dw_tile is not None:
                    _gemm_into(dw_tile, x.T, h_dw[sl], first=r0 == 0, alpha=alpha_dw)
                if db_acc is not None:
                    db_acc[v0:v0 + c] += x.sum(dim=0)
            if dw_tile is not None and dw_tile.dtype != dw.dtype:
                dw[v0:v0 + c].copy_(dw_tile)
        dh = None
        if dh_acc is not None:
            if dh_scale is not None:  # z = (h W^T + b) / τ, and the sign of the fast path
                dh_acc.mul_(dh_scale)
            if direct_dh:
                dh = dh_acc
            elif idx is None:
                dh = dh_acc.to(hidden.dtype)
            else:
                dh = torch.zeros_like(hidden).index_copy_(0, idx, dh_acc.to(hidden.dtype))
        db = None if db_acc is None else db_acc.mul_(-inv_t).to(bias.dtype)
    return dh, dw, db


def _row_blocks(B: int, T: int, C: int):
    """Split [B, T] rows into blocks of about C: whole sequences when C >= T, else pieces of one
    sequence. Yields (sequence slice, position slice, flat start); each block of a [B, T, V]
    view is then itself a view, so sliced logits are never copied whole."""
    if B * T == 0:  # no tokens (e.g. a packed batch of empty sequences): no blocks
        return
    if C >= T:
        step = C // T
        for b in range(0, B, step):
            yield slice(b, b + step), slice(0, T), b * T
    else:
        for b in range(B):
            for t in range(0, T, C):
                yield slice(b, b + 1), slice(t, t + C), b * T + t


def _block(x, buf, lead):
    """buf (flat) viewed as x's leading shape `lead` + x's last dimension."""
    return buf[:x.shape[-1] * lead[0] * lead[1]].view(*lead, x.shape[-1])


def _per_token(v, lead):
    """[b·t] -> [b, t, 1], to broadcast over a block's vocabulary."""
    return v.view(*lead, 1)


def logits_logprob_forward(logits, targets, temperature, chunk_elements=None):
    """logits [B, T, V], targets [B·T] -> float32 (logp, entropy, lse), each [B·T]."""
    B, T, V = logits.shape
    out = _empty_stats(B * T, logits.device)
    dtype, inv_t = _compute_dtype(logits), 1.0 / temperature
    C = _chunk_rows(V, chunk_elements)
    with torch.no_grad():
        z_buf, e_buf = (torch.empty(min(C, B * T) * V, dtype=dtype, device=logits.device)
                        for _ in range(2))
        for bs, ts, i in _row_blocks(B, T, C):
            x = logits[bs, ts]  # [b, t, V], a view of the input (read in its own dtype)
            lead = x.shape[:2]
            n = lead[0] * lead[1]
            m = x.amax(dim=-1).to(dtype).mul_(inv_t)  # [b, t]: the max of z = x / τ
            # z - m in the compute dtype: one pass that reads x and writes the buffer
            z = torch.add(m.neg()[..., None], x, alpha=inv_t, out=_block(x, z_buf, lead))
            picked = z.gather(-1, targets[i:i + n].view(*lead, 1)).view(n)  # z_target - m
            e = torch.exp(z, out=_block(x, e_buf, lead))
            s = e.sum(dim=-1).view(n)
            t = e.mul_(z).sum(dim=-1).view(n)  # Σ e^(z-m)·(z-m)
            log_s = s.log()
            logp, entropy, lse = (o[i:i + n] for o in out)
            logp.copy_(picked - log_s)  # z_target - lse, with lse = m + log s
            entropy.copy_(log_s - t / s)
            lse.copy_(m.view(n) + log_s)
    return out


def logits_logprob_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, out=None,
                            chunk_elements=None):
    """d logits [B, T, V] in logits' dtype, written into `out` (may be `logits` itself)."""
    B, T, V = logits.shape
    dx3 = torch.empty_like(logits) if out is None else out
    dtype, inv_t = _compute_dtype(logits), 1.0 / temperature
    C = _chunk_rows(V, chunk_elements)
    with torch.no_grad():
        z_buf = torch.empty(min(C, B * T) * V, dtype=dtype, device=logits.device)
        e_buf = None if g_ent is None else torch.empty_like(z_buf)
        for bs, ts, i in _row_blocks(B, T, C):
            x, dx = logits[bs, ts], dx3[bs, ts]  # [b, t, V] views
            lead = x.shape[:2]
            n = lead[0] * lead[1]
            g, gh = g_logp[i:i + n].to(dtype), None if g_ent is None else g_ent[i:i + n]
            if not (bool(g.any()) or (gh is not None and bool(gh.any()))):
                dx.zero_()
                continue
            per_token = functools.partial(_per_token, lead=lead)
            z = _block(x, z_buf, lead)
            lse_i = lse[i:i + n].to(dtype)
            if gh is None:
                # d x = -g/τ · (p - onehot): one pass from x to the tile (p = exp(x/τ - lse)),
                # one exp_, one small scatter, one pass from the tile into d x
                torch.add(per_token(-lse_i), x, alpha=inv_t, out=z).exp_()
                z.scatter_add_(-1, per_token(targets[i:i + n]), z.new_full((*lead, 1), -1.0))
                torch.mul(z, per_token(g * -inv_t), out=dx)
            else:
                torch.add(per_token(-lse_i), x, alpha=inv_t, out=z)  # log p
                _neg_dz_tile(z, _block(x, e_buf, lead), per_token(ent[i:i + n].to(dtype)),
                             per_token(g), per_token(gh.to(dtype)))
                z.scatter_add_(-1, per_token(targets[i:i + n]), per_token(-g))  # -d z
                torch.mul(z, -inv_t, out=dx)
    return dx3
