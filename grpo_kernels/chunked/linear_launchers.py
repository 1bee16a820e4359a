"""Chunked PyTorch launchers of the linear head: selective log-prob and entropy of the logits
z = (hidden @ weight.T + bias) / τ, and their backward (d hidden, d weight, d bias), without the
[N, V] logits ever existing whole.

Same contract as the Triton launchers in `kernels/linear_logprobs.py` and its backwards:
per-token statistics only (lse and entropy are saved, logits are not: the one exception is a
problem whose logits fit one tile, which a forward asked to `keep` it holds for its backward,
KEEP_ELEMENTS). The launchers of given logits [B, T, V] are in `logits_launchers.py`; the
package exports all four as the "chunked" backend. The trainer uses them on a laptop.

The logits are produced one [rows, cols] tile at a time (vocabulary tiles outer, token blocks
inner), so at most two tiles of float32 exist at once and each weight tile is read from memory
once per pass:
- forward keeps an online softmax per token (running max m, Σ e^(z-m) and Σ e^(z-m)·(z-m)), so
  lse and the entropy come out of one pass over the vocabulary (a tile that spans the vocabulary
  gives them directly);
- backward recomputes each tile, turns it into d z in place and feeds it straight to the two
  GEMMs (d hidden += d z @ W_tile, d W_tile += d z^T @ hidden). Tokens with no gradient (padding)
  are dropped before the tiles, and the target's one-hot term is added outside them (or, given
  the forward's logp, the target column's d z is written from it: `tiles.target_column`); given
  the forward's S = Σ 2^(z - lse·log2(e)) (`lse_sum`), every column's p is 2^(z - lse·log2(e))
  / S, exact where the lse alone is rounded at its magnitude (`tiles.row_offset`).
Logits always accumulate in float32 (float64 for float64 inputs), whatever the input dtype: half
operands are upcast a tile at a time (and hidden once, [N, D]), never the whole [V, D] weight.
Scratch buffers are allocated once per call, not per tile, and sized to the problem (a logits
tile never has more elements than N·V); nothing is zero-filled that a GEMM or a copy overwrites.
Each op over a whole tile is a parallel region, and on a shared CPU each region can wait for a
core, so the passes over a tile are kept few, and small per-token work uses ops that stay on the
calling thread (index_select, not advanced indexing, which forks threads at any size).
A float32 weight with bf16/fp16 hidden (mixed head precision) gives the fp32 head's logits of the
hidden states as given; each gradient comes back in its input's dtype.
Tiles hold their logits in log2 units, so that every exponential is PyTorch's exp2, about three
times faster than its exp on CPU; the per-tile operations are in `tiles.py`. Small problems pay
mostly per-op overhead, so a tile that spans the vocabulary (V within the tile budget, the common
case on CPU) skips the per-tile target bookkeeping, and one block that holds every token is
handed on without row views.
"""

from __future__ import annotations

import functools

import torch

from .blocks import (
    KEEP_ELEMENTS,
    active_rows,
    pick_rows,
    row_parts,
    tile_shape,
)
from .tiles import (
    LOG2E,
    BackwardMode,
    add_target_term,
    cap_tile_,
    compute_dtype,
    empty_stats,
    exp_sums,
    fast_mode,
    finish_stats,
    gemm_into,
    general_mode,
    head_transform,
    in_tile,
    kept_mode,
    log2_head,
    logits_tile,
    reference_sums,
    row_offset,
    tile_buffer,
    tile_sums,
    tile_update,
    view,
    weight_tile,
)


def linear_logprob_forward(hidden, weight, bias, targets, temperature, chunk_elements=None,
                           keep=None, softcap=None, logit_scale=None, lse_sum=None):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N]
    -> float32 (logp, entropy, lse), each [N].

    keep: None, or a dict that receives, when the [N, V] logits fit one tile of at most
    KEEP_ELEMENTS, "tile" = z - m (log2 units, [N, V], compute dtype) and "log_sum" =
    log2 Σ 2^(z - m) [N], for `linear_logprob_backward(kept=...)`: log2 p = tile - log_sum
    without the lse (nats, rounded at its magnitude); it stays empty otherwise (and with a soft
    cap).
    lse_sum: None, or a float32 [N] tensor that receives S = Σ 2^(z - lse·log2(e)) per token
    (`tiles.reference_sums`) for `linear_logprob_backward(lse_sum=...)` (not with a soft cap).
    softcap / logit_scale: z = cap(s·y) / τ of the raw logits y (`softcap.py`)."""
    N, V = hidden.shape[0], weight.shape[0]
    out = empty_stats(N, hidden.device)
    if N == 0:
        return out
    temperature, cap = head_transform(temperature, softcap, logit_scale)
    keep, lse_sum = (keep, lse_sum) if cap is None else (None, None)
    dtype = compute_dtype(hidden, weight, bias)
    rows, cols = tile_shape(N, V, chunk_elements, buffers=2)
    with torch.no_grad():
        # z = α·h @ W^T + b, log2 units; with a cap, α = s/c and the tile is capped after
        h, b, alpha = log2_head(hidden, bias, dtype, temperature,
                                alpha=None if cap is None else cap.pre)
        z_buf, e_buf = (torch.empty(rows * cols, dtype=dtype, device=h.device) for _ in range(2))
        w_buf = tile_buffer(weight, dtype, cols)
        if cols == V:  # whole rows: each row block's statistics directly, nothing carried over
            w = weight_tile(weight, 0, V, dtype, w_buf)
            for _, r, part in row_parts(N, rows):
                z = logits_tile(part(h), w, b, view(z_buf, r, V), alpha)  # [r, V]
                if cap is not None:
                    cap_tile_(z, cap)
                m = z.amax(dim=1)
                picked = z.gather(1, part(targets)[:, None]).squeeze_(1).sub_(m)  # z_target - m
                z.sub_(m[:, None])
                s, t = exp_sums(z, view(e_buf, r, V))
                finish_stats(m, s, t, picked, [part(o) for o in out])
                if lse_sum is not None:  # (finish_stats left m and s as they were)
                    part(lse_sum).copy_(reference_sums(m, s, part(out[2])))
                if keep is not None and r == N and N * V <= KEEP_ELEMENTS:
                    # z - m, and log2 s
                    keep.update(tile=z, log_sum=torch.xlogy(LOG2E, s))
            return out
        m, s, t, picked = (torch.zeros(N, dtype=dtype, device=h.device) for _ in range(4))
        for v0 in range(0, V, cols):
            w = weight_tile(weight, v0, cols, dtype, w_buf)  # [c, D]
            bt = None if b is None else b[v0:v0 + cols]
            c = w.shape[0]
            col, inside = in_tile(targets, v0, c)
            for _, r, part in row_parts(N, rows):
                z = logits_tile(part(h), w, bt, view(z_buf, r, c), alpha)
                if cap is not None:
                    cap_tile_(z, cap)
                pk = part(picked)
                pk.copy_(torch.where(part(inside), z.gather(1, part(col)).squeeze(1), pk))
                tile_update(z, view(e_buf, r, c), part(m), part(s), part(t), first=v0 == 0)
        finish_stats(m, s, t, picked.sub_(m), out)  # picked: z_target, gathered before the shift
        if lse_sum is not None:  # (finish_stats left m and s as they were)
            lse_sum.copy_(reference_sums(m, s, out[2]))
    return out


def linear_logprob_backward(
    hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature,
    needs=(True, True, True), chunk_elements=None, grad_filter=None, kept=None,
    softcap=None, logit_scale=None, shard_targets=False, logp=None, lse_sum=None, own_sums=None,
):
    """Gradients of Σ g_logp·logp + Σ g_ent·H (see
    `linear_backward_atomic.linear_logprob_backward_atomic`).

    Always exact: gradient filtering (`grad_filter`) saves work only in the Triton atomic
    backward; here every tile is one dense matmul either way.
    kept: None or the forward's `keep` dict; its tile is used instead of a GEMM, overwritten and
    taken out of the dict (a dict filled by one forward serves one backward; an empty one means
    recompute).
    lse_sum: None or the forward's `lse_sum` [N]: a recomputed tile reads p as
    2^(z - lse·log2(e)) / S, not through the lse alone (`tiles.row_offset`). own_sums: None or
    f, S = f(S over this backward's own tiles, `tiles.tile_sums`) in place of lse_sum.

    Each logits tile is turned into x with d z = σ·x per token (z in nats), in one of two modes
    made with each token's `tiles.row_offset` (log2 p - the tile, from lse or the kept tile):
    `fast_mode` (no bias, no entropy gradient) or `general_mode`; `kept_mode` starts either
    of them from the forward's kept tile instead of a GEMM. `_tile_pass` runs the tiles.
    A logit scale alone is a temperature here (`tiles.head_transform`); a soft cap runs
    `softcap.linear_backward`.
    shard_targets: the weight is one vocabulary shard (grpo_kernels/parallel) and an id
    outside [0, V) is another shard's target: no one-hot term for it (the soft-cap backward
    finds each target's tile this way always).
    logp: None or the forward's log-probs [N] (float32): the target column's x comes from them
    (`tiles.target_column`), not from the recomputed tile and the lse."""
    temperature, cap = head_transform(temperature, softcap, logit_scale)
    if cap is not None:
        from .softcap import linear_backward

        return linear_backward(hidden, weight, bias, targets, lse, ent, g_logp, g_ent,
                               temperature, softcap, logit_scale, needs, chunk_elements,
                               logp=logp)
    want_dh, want_dw = bool(needs[0]), bool(needs[1])
    want_db = bias is not None and bool(needs[2])
    idx = active_rows(g_logp, g_ent)
    V = weight.shape[0]
    if (hidden.shape[0] == 0 or (idx is not None and idx.numel() == 0) or V == 0
            or not (want_dh or want_dw or want_db)):
        # no tokens, or masked tokens only: no work (and d W must be zeros, not left unwritten)
        return tuple(torch.zeros_like(x) if want else None
                     for x, want in ((hidden, want_dh), (weight, want_dw), (bias, want_db)))
    dtype, inv_t = compute_dtype(hidden, weight, bias), 1.0 / temperature
    pick = functools.partial(pick_rows, idx=idx, dtype=dtype)  # [N, ...] -> active rows [Na, ...]
    with torch.no_grad():
        h, b, alpha = log2_head(pick(hidden), bias, dtype, temperature)  # [Na, D]
        g, gh, from_tile = pick(g_logp), pick(g_ent), bool(kept)
        offset, sums = row_offset(lse, kept, pick, lse_sum)  # [Na] each; sums: S or None
        fast = b is None and gh is None  # fast_mode: one tile buffer, general_mode: two
        rows, cols = tile_shape(h.shape[0], V, chunk_elements, buffers=1 if fast else 2)
        if own_sums is not None and not from_tile:
            sums = own_sums(tile_sums(weight, h, b, offset, alpha, rows, cols))
        if fast:
            mode = fast_mode(h, g, offset, inv_t, alpha, want_dw, pick(logp), sums)
        else:
            ent_a = None if gh is None else pick(ent)
            mode = general_mode(h, g, gh, offset, ent_a, inv_t, alpha, pick(logp), sums)
        z_buf = None
        if from_tile:  # the forward's z - m [N, V]: the active rows, in one tile
            mode, z_buf = kept_mode(mode, kept, idx)
            rows, cols = h.shape[0], V
        # d hidden accumulates over vocabulary tiles in the compute dtype: [Na, D]; the first
        # vocabulary tile writes it, so nothing is zeroed
        dh_acc = None
        if want_dh:
            direct_dh = idx is None and hidden.dtype == dtype
            dh_acc = torch.empty_like(hidden) if direct_dh else torch.empty_like(h)
        dw, db_acc = _tile_pass(weight, h, b, pick(targets), mode, rows, cols, z_buf, dh_acc,
                                want_dw, want_db, shard_targets)
        dh = None if dh_acc is None else _hidden_grad(dh_acc, mode.dh_scale, hidden, idx)
        db = None if db_acc is None else db_acc.mul_(-inv_t).to(bias.dtype)
    return dh, dw, db


def _tile_pass(weight, h, b, tg, mode: BackwardMode, rows, cols, z_buf, dh_acc, want_dw, want_db,
               shard_targets=False):
    """Vocabulary tiles (outer) by token blocks (inner): each [r, c] tile becomes x
    (`mode.tile`), gets its target column (`tiles.add_target_term`), and feeds
    d hidden += x @ W_tile (into dh_acc [Na, D]), d W_tile += x^T @ h_dw and d b_tile += Σ x.
    h [Na, D], b [V] | None, tg [Na]; z_buf: a given tile buffer or None. Returns (d W [V, D]
    in weight's dtype, d b [V] in the compute dtype), None where not wanted."""
    Na, D = h.shape
    V, dtype = weight.shape[0], h.dtype
    dw = torch.empty_like(weight) if want_dw else None  # every vocabulary tile is written
    dw_buf = None
    if want_dw and weight.dtype != dtype:  # [c, D] of d W in the compute dtype
        dw_buf = torch.empty(min(cols, V) * D, dtype=dtype, device=h.device)
    db_acc = torch.zeros(V, dtype=dtype, device=h.device) if want_db else None
    if z_buf is None:
        z_buf = torch.empty(rows * cols, dtype=dtype, device=h.device)
    e_buf = torch.empty(rows * cols, dtype=dtype, device=h.device) if mode.scratch else None
    w_buf = tile_buffer(weight, dtype, cols)
    target_x = mode.target_x
    for v0 in range(0, V, cols):
        w = weight_tile(weight, v0, cols, dtype, w_buf)  # [c, D]
        c = w.shape[0]
        bt = b if b is None or c == V else b[v0:v0 + c]
        if c == V and not shard_targets:  # every target is in the tile
            col, inside = tg[:, None], None
        else:  # (shard targets: ids outside [0, V) are in no tile)
            col, inside = in_tile(tg, v0, c)
        # d W of this tile accumulates over token blocks, then is written once
        dw_tile = None
        if want_dw:
            dw_tile = view(dw, c, D) if c == V else dw[v0:v0 + c]
            dw_tile = dw_tile if dw.dtype == dtype else view(dw_buf, c, D)
        for r0, r, part in row_parts(Na, rows):
            x = mode.tile(view(z_buf, r, c), part, w, bt, view(e_buf, r, c))
            add_target_term(x, part(col), None if inside is None else part(inside),
                            part(mode.one_hot), None if target_x is None else part(target_x))
            if dh_acc is not None:
                gemm_into(part(dh_acc), x, w, first=v0 == 0, alpha=mode.alpha_dh)
            if dw_tile is not None:
                gemm_into(dw_tile, x.T, part(mode.h_dw), first=r0 == 0, alpha=mode.alpha_dw)
            if db_acc is not None:
                db_acc[v0:v0 + c] += x.sum(dim=0)
        if dw_tile is not None and dw_tile.dtype != dw.dtype:
            dw[v0:v0 + c].copy_(dw_tile)
    return dw, db_acc


def _hidden_grad(dh_acc, dh_scale, hidden, idx):
    """d hidden [N, D] in hidden's dtype from the accumulated [Na, D]: zero on inactive rows."""
    if dh_scale is not None:  # z = (h W^T + b) / τ, and the sign of the fast path
        dh_acc.mul_(dh_scale)
    if idx is None:
        return dh_acc.to(hidden.dtype)  # itself when it already is
    return torch.zeros_like(hidden).index_copy_(0, idx, dh_acc.to(hidden.dtype))
