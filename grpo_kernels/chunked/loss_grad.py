"""The linear head's loss gradient inside the forward: three matrix products instead of four.

For a loss of per-token terms

    L = Σ_n f_n(logp_n) + Σ_n g_H,n·H_n

where f_n reads token n's own log-prob only (the token-level GRPO losses: f_n = weight·ℓ) and
g_H is a fixed per-token entropy coefficient (the entropy bonus), each row of d L / d logits
depends on that row's logits and on nothing else of the batch. So once a chunk of rows holds its
logits over the whole vocabulary, its log-sum-exp, log-probs and entropies are known, the
caller's `d_logp` gives c_n = f_n'(logp_n), and the chunk's d logits goes straight into the two
gradient GEMMs:

    pass 1  z = h @ W^T (+ b), the chunk's logits [C, V]
    pass 2  d hidden[chunk] = d y @ W                [C, D]
    pass 3  d W += d y^T @ h[chunk]                   [V, D]   (d b += Σ_rows d y)

against four for the forward + backward of `launchers.py` (the backward recomputes the logits).
d y is the backward's (`tiles.neg_dz_tile`, `tiles.general_mode`): with z in nats, p = softmax(z),
y the raw logits and z = y / τ,

    d y = -x / τ,   x = p·(c + g_H·(ln p + H)) - c·onehot

(the log-prob's part of it is d logp / dz = onehot - p, the entropy's d H / dz = -p·(ln p + H)).
Without an entropy coefficient x = (c/s)·(e - s·onehot), e = 2^(z - m) the chunk's exponentials
and s = Σ e, so the per-token factor c/s rides on the [C, D] sides of the GEMMs (onto d hidden
after its GEMM, onto h before d W's) and the tile itself only gets the target's -s: no pass over
the tile beyond those the statistics need.

Chunks hold whole rows ([C, V], two such buffers: the logits and their exponentials) within the
chunked path's element budget, as the forward's whole-row tiles (`blocks._tile_shape`);
`whole_rows` says how many, or that whole rows do not fit (then the caller keeps the four-pass
path). Only the rows the caller lists (`rows`: tokens with a non-zero mask) are computed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .blocks import _pick, _row_parts, _tile_shape
from .tiles import (
    LN2,
    compute_dtype,
    empty_stats,
    finish_stats,
    head_transform,
    log2_head,
    logits_tile,
    tile_buffer,
    view,
    weight_tile,
)


class LossGrad(NamedTuple):
    """What `linear_loss_grad` returns. Per-token values cover the Na rows computed, in the
    order of `rows`, float32; gradients are in their inputs' dtypes (None where not wanted)."""

    logp: torch.Tensor  # [Na]
    entropy: torch.Tensor  # [Na], nats
    lse: torch.Tensor  # [Na], nats, of z = y / τ
    coef: torch.Tensor  # [Na]: c = d L / d logp, as `d_logp` gave it
    d_hidden: torch.Tensor | None  # [N, D], zero on rows not computed
    d_weight: torch.Tensor | None  # [V, D]
    d_bias: torch.Tensor | None  # [V]


CPU_BUDGET_BYTES = 2**28  # TEMPORARY shim until the budget rule lands


def chunk_rows(n, V, D, weight_dtype, budget_bytes):  # TEMPORARY shim
    rows = max(1, min(max(n, 1), budget_bytes // (2 * 4 * max(V, 1))))
    return rows, ""


def whole_rows(n: int, V: int, chunk_elements: int | None = None) -> int | None:
    """Rows of one [rows, V] chunk for n tokens, two such buffers within the element budget and
    at least min(n, TILE_ROWS) rows (as the forward's whole-row tiles), or None when whole rows
    do not fit that budget (a large vocabulary: the tiles then split it)."""
    rows, cols = _tile_shape(max(n, 1), V, chunk_elements, buffers=2)
    return rows if cols == V else None


def linear_loss_grad(hidden, weight, bias, targets, temperature,
                     d_logp: Callable[[int, int, torch.Tensor], torch.Tensor],
                     g_ent=None, rows=None, needs=(True, True, True), chunk_elements=None,
                     logit_scale=None, chunk_rows=None, budget_bytes=None) -> LossGrad:
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N]; z = s·(h W^T + b) / τ.

    d_logp(r0, r, logp): for rows r0:r0 + r of the computed ones (in `rows` order), logp [r]
    float32 -> c = d L / d logp [r] float32; called once per chunk, in order. g_ent: [N] float32
    entropy coefficients g_H, or None. rows: int64 indices of the tokens to compute (None: all);
    the others get no statistics and a zero d hidden. needs: (d hidden, d weight, d bias).
    A logit scale s is a temperature here (`tiles.head_transform`); soft caps do not come here.
    chunk_rows: rows per chunk (default `whole_rows`; a ValueError when whole rows do not fit
    the budget)."""
    temperature, _ = head_transform(temperature, None, logit_scale)
    want_dh, want_dw = bool(needs[0]), bool(needs[1])
    want_db = bias is not None and bool(needs[2])
    V, D = weight.shape
    dtype = compute_dtype(hidden, weight, bias)
    pick = functools.partial(_pick, idx=rows, dtype=dtype)  # [N, ...] -> [Na, ...]
    Na = hidden.shape[0] if rows is None else rows.numel()
    C = chunk_rows or (whole_rows(Na, V, chunk_elements) if budget_bytes is None else
                       globals()["chunk_rows"](Na, V, D, weight.dtype, budget_bytes)[0])
    if C is None:
        raise ValueError(f"whole vocabulary rows (V = {V}) do not fit the chunk budget")
    logp, ent, lse = empty_stats(Na, hidden.device)
    coef = torch.zeros(Na, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        h, b, alpha = log2_head(pick(hidden), bias, dtype, temperature)  # [Na, D], z in log2
        tg, gh = pick(targets), pick(g_ent)
        w = weight_tile(weight, 0, V, dtype, tile_buffer(weight, dtype, V))  # [V, D]
        z_buf, e_buf = (torch.empty(min(C, Na) * V, dtype=dtype, device=h.device)
                        for _ in range(2))
        dh = torch.empty_like(h) if want_dh else None  # [Na, D], every chunk writes its rows
        dw = None
        if want_dw:  # [V, D] in the compute dtype, the first chunk writes it
            dw = torch.empty_like(weight) if weight.dtype == dtype else torch.empty(
                V, D, dtype=dtype, device=h.device)
        db = torch.zeros(V, dtype=dtype, device=h.device) if want_db else None
        for r0, r, part in _row_parts(Na, C):
            stats = [part(logp), part(ent), part(lse)]
            z, e, s = _chunk_stats(part(h), w, b, alpha, part(tg)[:, None], view(z_buf, r, V),
                                   view(e_buf, r, V), stats, keep_z=gh is not None)
            c = part(coef)
            c.copy_(d_logp(r0, r, stats[0]))
            x, scale = _d_logits(z, e, s, c.to(dtype), None if gh is None else part(gh),
                                 stats, part(tg)[:, None], -1.0 / temperature)
            _accumulate(x, scale, part(h), w, None if dh is None else part(dh), dw, db,
                        first=r0 == 0)
        d_hidden = None if dh is None else _scatter_rows(dh, hidden, rows)
        d_weight = None if dw is None else (dw if Na else dw.zero_()).to(weight.dtype)
        d_bias = None if db is None else db.to(bias.dtype)
    return LossGrad(logp, ent, lse, coef, d_hidden, d_weight, d_bias)


def _chunk_stats(h, w, b, alpha, col, z, e, out, keep_z: bool):
    """One chunk's logits and statistics. h [r, D], w [V, D], b [V] | None (log2 units), col
    [r, 1] target columns; z, e [r, V] buffers. Writes out = (logp, entropy, lse) [r] and
    returns (z - m [r, V] log2 units, overwritten unless keep_z, e = 2^(z - m) [r, V],
    s = Σ e [r])."""
    z = logits_tile(h, w, b, z, alpha)  # α·h W^T + b: z in log2 units
    m = z.amax(dim=1)
    picked = z.gather(1, col).squeeze_(1).sub_(m)  # z_target - m
    z.sub_(m[:, None])
    torch.exp2(z, out=e)
    s = e.sum(dim=1)
    if keep_z:  # Σ e·(z - m) as r dot products: no [r, V] temporary
        t = torch.bmm(e[:, None, :], z[:, :, None]).view(-1)
    else:  # z - m is not needed any more: the product in its buffer, then the sum (faster)
        t = z.mul_(e).sum(dim=1)
    finish_stats(m, s, t, picked, out)  # leaves m and s as they were
    return z, e, s


def _d_logits(z, e, s, c, gh, out, col, neg_inv_t):
    """x [r, V] and its row scale σ (a [r, 1] tensor or a number) with d y = σ·x, d y the
    gradient of L w.r.t. the raw logits of the chunk (see the module docstring). z = z - m and
    e = 2^(z - m) [r, V] (log2 units; both may be overwritten), s = Σ e [r], c [r] = d L / d logp,
    gh [r] = g_H or None, out = (logp, entropy, lse) [r], col [r, 1] target columns."""
    if gh is None:
        # x = e - s·onehot, σ = -c/(s·τ): p - onehot = (e - s·onehot)/s
        e.scatter_add_(1, col, -s[:, None])
        return e, (c / s * neg_inv_t)[:, None]
    # x = p·(c + g_H·(ln p + H)) - c·onehot with p = e/s and ln p = ln2·(z - m) - ln s:
    # p·(a + k·(z - m)), a = c + g_H·(H - ln s), k = g_H·ln 2 (per token)
    _, ent, lse = out
    dtype = z.dtype
    log_s = torch.xlogy(1.0, s)  # ln s (torch.log forks threads, see tiles.finish_stats)
    a = (c + gh * (ent.to(dtype) - log_s)) / s
    k = gh * LN2 / s
    x = torch.addcmul(a[:, None], z, k[:, None], out=z).mul_(e)  # [r, V], in z's buffer
    x.scatter_add_(1, col, -c[:, None])
    return x, neg_inv_t


def _accumulate(x, scale, h, w, dh, dw, db, first: bool) -> None:
    """d y = scale·x for one chunk (x [r, V]; scale [r, 1] or a number): d hidden rows
    dh [r, D] = d y @ W, d W [V, D] (+)= d y^T @ h (written when `first`), d b [V] += Σ_rows d y."""
    per_row = isinstance(scale, torch.Tensor)
    if dh is not None:
        torch.mm(x, w, out=dh)
        dh.mul_(scale)
    if dw is not None:
        h_dw = h * scale if per_row else h
        torch.addmm(dw, x.T, h_dw, beta=0.0 if first else 1.0,
                    alpha=1.0 if per_row else scale, out=dw)
    if db is not None:
        if per_row:
            torch.addmv(db, x.T, scale.view(-1), out=db)
        else:
            db.add_(x.sum(dim=0), alpha=scale)


def _scatter_rows(dh, hidden, rows):
    """d hidden [N, D] in hidden's dtype from the computed rows' [Na, D]: zero elsewhere."""
    if rows is None:
        return dh.to(hidden.dtype)
    return torch.zeros_like(hidden).index_copy_(0, rows, dh.to(hidden.dtype))
