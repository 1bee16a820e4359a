"""Chunked PyTorch launchers of given logits: selective log-prob and entropy of logits
[B, T, V] (z = logits / τ), and their backward d logits [B, T, V], one block of rows at a time.

Same contract as the Triton launchers in `kernels/logits_logprobs.py`: per-token statistics
only (lse and entropy; a forward asked to `keep` also hands its backward each token's max m
and s = Σ 2^(z - m)). The linear head's launchers are in `linear_launchers.py`, whose
docstring gives what both share: float32 accumulation (float64 for float64 inputs), scratch
buffers allocated once per call, logits held in log2 units so that every exponential is exp2.

The input is cut into row blocks of at most `chunk_elements` elements (`blocks.row_blocks`):
whole sequences, or pieces of one; each block is a view of the input, read in its own dtype, so
sliced logits are never copied whole. The forward writes z - m of a block into one scratch
buffer and takes lse, the entropy and the target's log-prob from it; the backward writes d x of
a block straight into `out` (which may be the logits themselves). A soft cap or a logit scale
hands the call to `softcap.py`; rows a Triton forward skipped (NaN lse) are recomputed here.
"""

from __future__ import annotations

import functools

import torch

from .blocks import block_rows, block_view, row_blocks, zero_rows_without_gradient
from .tiles import (
    LN2,
    LOG2E,
    compute_dtype,
    empty_stats,
    exp_sums,
    finish_stats,
    neg_dz_tile,
)


def logits_logprob_forward(logits, targets, temperature, chunk_elements=None, softcap=None,
                           logit_scale=None, keep=None):
    """logits [B, T, V], targets [B·T] -> float32 (logp, entropy, lse), each [B·T].
    softcap / logit_scale: the logits are raw, z = cap(s·logits) / τ (`softcap.py`).
    keep: None, or a dict that receives each token's "max" = m (log2 units) and "sum" =
    s = Σ 2^(z - m) ([B·T] each, compute dtype) for `logits_logprob_backward(kept=...)`, which
    then reads p as 2^(z - m) / s and not through the lse in nats (rounded at its magnitude);
    it stays empty with a transform."""
    if softcap is not None or logit_scale is not None:
        from .softcap import logits_forward

        return logits_forward(logits, targets, temperature, softcap, logit_scale, chunk_elements)
    B, T, V = logits.shape
    out = empty_stats(B * T, logits.device)
    dtype, scale = compute_dtype(logits), LOG2E / temperature
    C = block_rows(V, chunk_elements)
    stats = None
    if keep is not None:
        stats = [torch.empty(B * T, dtype=dtype, device=logits.device) for _ in range(2)]
        keep.update(max=stats[0], sum=stats[1])
    with torch.no_grad():
        z_buf, e_buf = (torch.empty(min(C, B * T) * V, dtype=dtype, device=logits.device)
                        for _ in range(2))
        for rows, tokens in row_blocks(B, T, C):
            x = rows(logits)  # [b, t, V], a view of the input (read in its own dtype)
            m = x.amax(dim=-1).to(dtype).mul_(scale)  # [b, t]: the max of z = x·log2(e)/τ
            # z - m in the compute dtype: one pass that reads x and writes the buffer
            z = torch.add(m.neg()[..., None], x, alpha=scale, out=block_view(z_buf, x.shape))
            picked = z.gather(-1, tokens(targets).view(*x.shape[:2], 1)).view(-1)  # z_target - m
            s, t = exp_sums(z, block_view(e_buf, x.shape))
            finish_stats(m.view(-1), s.view(-1), t.view(-1), picked, [tokens(o) for o in out])
            if stats is not None:  # m and s (finish_stats left both as they were)
                tokens(stats[0]).copy_(m.view(-1))
                tokens(stats[1]).copy_(s.view(-1))
    return out


def logits_logprob_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, out=None,
                            chunk_elements=None, softcap=None, logit_scale=None,
                            shard_targets=False, skipped_rows=False, kept=None):
    """d logits [B, T, V] in logits' dtype, written into `out` (may be `logits` itself; its
    dtype may differ). shard_targets: an id outside [0, V) is another vocabulary shard's
    (grpo_kernels/parallel) and adds no one-hot term (no soft cap or scale then).
    skipped_rows: lse may mark rows a Triton forward skipped (NaN); they are recomputed first
    (this backend runs such a backward only when the Triton one failed to build).
    kept: None or the forward's `keep` dict (taken out of it): the statistics p is read from.

    Per token, p = 2^(z - ref) / s: ref = m and s from `kept`, else ref = lse·log2(e) and
    s = 1. The tile holds 2^(z - ref) = s·p, so s goes with the one-hot term and 1/s with the
    per-token factor of d x: no pass over the tile for it."""
    if skipped_rows:
        lse, ent = _with_skipped_rows(logits, targets, lse, ent, temperature, chunk_elements,
                                      softcap, logit_scale)
    if softcap is not None or logit_scale is not None:
        from .softcap import logits_backward

        return logits_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, softcap,
                               logit_scale, out, chunk_elements)
    B, T, V = logits.shape
    dx3 = torch.empty_like(logits) if out is None else out
    dtype, inv_t = compute_dtype(logits), 1.0 / temperature
    scale = LOG2E * inv_t  # z = x·log2(e)/τ: logits in log2 units
    C = block_rows(V, chunk_elements)
    ref, sums = _logits_reference(lse, kept, dtype)  # [B·T] each (ref in log2 units)
    with torch.no_grad():
        z_buf = torch.empty(min(C, B * T) * V, dtype=dtype, device=logits.device)
        e_buf = None if g_ent is None else torch.empty_like(z_buf)
        for rows, tokens in row_blocks(B, T, C):
            x, dx = rows(logits), rows(dx3)  # [b, t, V] views
            per_token = functools.partial(torch.Tensor.view, size=(*x.shape[:2], 1))
            g, gh = tokens(g_logp).to(dtype), None if g_ent is None else tokens(g_ent)
            if not (bool(g.any()) or (gh is not None and bool(gh.any()))):
                dx.zero_()
                continue
            z = block_view(z_buf, x.shape)
            neg_ref = per_token(-tokens(ref))
            ids = per_token(tokens(targets))
            s = None if sums is None else per_token(tokens(sums))  # [b, t, 1]
            one = z.new_full(ids.shape, -1.0) if s is None else -s  # the one-hot's term, s·-1
            if shard_targets:  # another shard's target: no term (the column is a dummy)
                one, ids = one * (ids >= 0), ids.clamp(min=0)
            if gh is None:
                # d x = -g/τ · (p - onehot) = -g/(τ·s) · (2^(z - ref) - s·onehot): one pass from
                # x to the tile, one exp2_, one small scatter, one pass from the tile into d x
                torch.add(neg_ref, x, alpha=scale, out=z).exp2_()
                z.scatter_add_(-1, ids, one)
                factor = per_token(g * -inv_t)
                torch.mul(z, factor if s is None else factor / s, out=dx)
            else:
                torch.add(neg_ref, x, alpha=scale, out=z)  # log2 p + log2 s
                ent2 = per_token(tokens(ent).to(dtype) * LOG2E)  # H·log2(e)
                # s·(-d z without the one-hot): log2 p + H·log2(e) = z - ref + (H·log2(e) - log2 s)
                neg_dz_tile(z, block_view(e_buf, x.shape),
                            ent2 if s is None else ent2 - torch.xlogy(LOG2E, s),
                            per_token(g), per_token(gh.to(dtype) * LN2))
                z.scatter_add_(-1, ids, one * per_token(g))  # -s·d z
                torch.mul(z, -inv_t if s is None else -inv_t / s, out=dx)
            zero_rows_without_gradient(dx, g, gh)
    return dx3


def _logits_reference(lse, kept, dtype):
    """(ref, s) [B·T] with p = 2^(z - ref) / s (ref in log2 units): the forward's m and s taken
    out of `kept` when it holds them, else (lse·log2(e), None: s = 1)."""
    if kept:
        return kept.pop("max"), kept.pop("sum")
    return lse.to(dtype) * LOG2E, None


def _with_skipped_rows(logits, targets, lse, ent, temperature, chunk_elements, softcap,
                       logit_scale):
    """(lse, entropy) [B·T] with the rows marked NaN recomputed (copies; one host read)."""
    stale = torch.isnan(lse)
    if not bool(stale.any()):
        return lse, ent
    V = logits.shape[-1]
    idx = stale.nonzero().squeeze(1)
    rows = logits.reshape(-1, V).index_select(0, idx).view(-1, 1, V)
    _, ent_now, lse_now = logits_logprob_forward(rows, targets.index_select(0, idx),
                                                 temperature, chunk_elements, softcap,
                                                 logit_scale)
    return lse.index_copy(0, idx, lse_now), ent.index_copy(0, idx, ent_now)
