"""The three-pass route (`ops/three_pass.py`) on a vocabulary-parallel head: the loss's gradient
formed in the forward, chunk by chunk, with the statistics combined across the shards between a
chunk's logits and its d-logits.

Per chunk of C whole rows of this rank's shard (C from the largest shard, `VocabShard.max_rows`,
so that every rank runs as many chunks and as many collectives):

  1. y = h[c] @ W_r^T (+ b_r)       [C, V_r] float32, a library GEMM (`kernels.gemm.product`)
  2. the backend's row forward on y (`logits_logprob_forward`, Triton or chunked): lse_r, H_r,
     the log-prob of the local target id, and the shard's max m_r and s_r = Σ 2^(z - m_r)
     (chunked; Triton: its lse's terms m_r and log s_r in nats, `combine.split_reference`)
  3. one all-gather of [4, C] float64 (`combine.py`): logp, H, lse of the whole vocabulary and
     p's reference (M, S)
  4. the GRPO per-token loss on the combined log-prob and its derivative c = d(weight·ℓ)/dlogp
     (`grpo_math`, through `ops.three_pass._TokenTerms`), the same on every rank
  5. the backend's row backward from the global statistics with g_logp = c, g_H = the entropy
     bonus's weights: d y [C, V_r] in the GEMM dtype, over the logits of step 1
     (`kernels.linear_loss_grad.dlogits_over`), the one-hot term only on the rank that holds
     the target (ids outside the shard are -1); the chunked launcher reads p = 2^(z - M) / S,
     the Triton kernel p = e^((z - m) - ln S) with m = ln2·M (`combine.Stats.split`): a
     dominant token's p to float32's precision, target or not, where e^(z - lse) would carry
     the float32 lse's rounding; the target column's p - 1 from logp
  6. d hidden[c] = d y @ W_r (a partial sum), d W_r += d y^T @ h[c], d b_r += Σ d y
     (`kernels.linear_loss_grad._Grads`)

then one all-reduce of d hidden [N, D] over the group. d W and d b stay local. Three [N, V_r, D]
products per rank, as on a whole head. Reading p against the combined statistics costs no
communication beyond step 3's all-gather (32 bytes per row per rank). A second backward of a
graph kept with retain_graph runs the passes again from the saved coefficients c (its logits'
GEMMs may round unlike the first ones, so p is read against statistics combined over them):
the same collectives as the first call. Memory: one [C, V_r] float32 buffer (d y written over
its rows), and on the chunked backend the row launchers' scratch, blocks of an eighth of the
chunk.

What it leaves out, against the whole head's three-pass: the per-token GRPO math is PyTorch on
both backends (the Triton GRPO epilogue reads a log-prob that exists only after step 3), and the
chunked backend runs the row launchers on a materialized chunk instead of `chunked.loss_grad`'s
fused passes. A logit scale s > 0 is folded into the temperature (z = y / (τ / s)); a negative one
keeps the four-pass route (`ops/route.py`).
"""

from __future__ import annotations

import torch

from .. import chunked, value_checks
from ..kernels import gemm
from ..kernels import linear_loss_grad as triton_loss_grad
from ..kernels import logits_logprobs as triton_rows
from ..ops import fallback
from ..ops.route import chunk_budget_bytes
from ..ops.three_pass import (  # the whole head's pieces, shared
    Saved,
    ThreePass,
    ThreePassLoss,
    _full,
    _rows,
    _TokenTerms,
    grad_by_autograd,
)
from .combine import all_reduce_, combine, shard_targets, split_reference
from .shard import VocabShard

F32 = torch.float32


def _scratch(y) -> int:
    """The chunked row launchers' block (elements of each of their scratch buffers): an eighth
    of the chunk, so that their scratch stays a small part of the chunk's own buffer."""
    return max(y.shape[1], y.numel() // 8)


def _row_forward(backend: str, y, ids, temperature, out, split) -> tuple:
    """(logp, entropy, lse) of the rows of y [r, V_r] float32 into out, three [r] float32;
    returns the shard's (c_r, s_r) [r] each (`combine`): the chunked launcher's max and sum,
    on Triton from its lse's terms (m, log s), written into split, two [r] float32."""
    y3 = y.view(y.shape[0], 1, y.shape[1])
    if backend == "triton":
        triton_rows.logits_logprob_forward(y3, ids, temperature, out=out, split_out=split)
        return split_reference(*split)
    keep = {}
    for o, x in zip(out, chunked.logits_logprob_forward(y3, ids, temperature, _scratch(y),
                                                        keep=keep)):
        o.copy_(x)
    return keep["max"], keep["sum"]


def _row_backward(backend: str, y, ids, stats, c, gh, temperature, d) -> None:
    """d y [r, V_r] (into d, the GEMM dtype; d is y itself or a narrower view over its rows:
    both launchers read a row's elements before they write over them) of Σ c·logp + Σ gh·H
    from the global `combine.Stats` of the rows."""
    y3, d3 = y.view(y.shape[0], 1, y.shape[1]), d.view(d.shape[0], 1, d.shape[1])
    if backend == "triton":  # its row kernel compares column ids: -1 matches none
        triton_rows.logits_logprob_backward(y3, ids, stats.lse, stats.entropy, c, gh,
                                            temperature, out=d3, logp=stats.logp,
                                            split=stats.split())
    else:
        chunked.logits_logprob_backward(y3, ids, stats.lse, stats.entropy, c, gh, temperature,
                                        out=d3, chunk_elements=_scratch(y),
                                        shard_targets=True, kept=stats.kept())


def _chunks(shard: VocabShard, Na: int, D: int, backend: str) -> int:
    """Rows per chunk: the whole head's rule (`kernels.linear_loss_grad.chunk_rows`: a float32
    logits chunk, the d logits over it, within the budget) at the largest shard, the same on
    every rank."""
    return triton_loss_grad.chunk_rows(Na, shard.max_rows, D, chunk_budget_bytes(backend))


def _compute(shard, backend, head, ids, grpo_args, g_ent, rows, needs, temperature,
             given=None):
    """Per-token values [Na] and the local gradients of the computed rows (module docstring).
    given: None, or the coefficients c [N] of an earlier call to take instead of the GRPO
    terms' (a recompute: the per-token loss values are then left 0)."""
    hidden, weight, bias = head
    pick = lambda x: x if x is None or rows is None else x.index_select(0, rows)  # noqa: E731
    h_all, gh_all = pick(hidden).contiguous(), pick(g_ent)
    fwd_ids, bwd_ids, owner = (pick(x) for x in shard_targets(ids, shard))
    given = pick(given)
    terms = _TokenTerms(grpo_args, rows, grad_by_autograd)
    (Na, D), V = h_all.shape, weight.shape[0]
    dt = torch.promote_types(hidden.dtype, weight.dtype)  # the GEMMs' dtype
    C = _chunks(shard, Na, D, backend)
    f32 = dict(device=hidden.device, dtype=F32)
    logp, ent, lse, coef = (torch.zeros(Na, **f32) for _ in range(4))
    # the shard's own statistics: logp, H, lse, and the Triton forward's m and log s
    local = [torch.empty(min(C, Na), **f32) for _ in range(5)]
    grads = triton_loss_grad._Grads(h_all, weight, bias, needs, several=C < Na)
    if grads.dh is not None and grads.dh.dtype != torch.float64:
        # d hidden's partial sums in float32: summed over the group, then rounded once
        grads.dh = torch.empty(grads.dh.shape, **f32)
    y_buf = torch.empty(min(C, Na), V, **f32)
    d_buf = triton_loss_grad.dlogits_over(y_buf, dt) if grads.wanted else None  # d y over y
    for r0 in range(0, Na, C):
        sl = slice(r0, min(r0 + C, Na))
        r = sl.stop - r0
        h, y = h_all[sl].to(dt), y_buf[:r]
        gemm.product(y, h, weight.T, bias)
        mine = [x[:r] for x in local]
        ref_r, sum_r = _row_forward(backend, y, fwd_ids[sl], temperature, mine[:3], mine[3:])
        stats = combine(shard, ref_r, sum_r, mine[0], mine[1], owner[sl])
        for x, s in zip((logp, ent, lse), stats):
            x[sl] = s
        coef[sl] = terms.d_logp(r0, r, logp[sl]) if given is None else given[sl]
        if d_buf is not None:
            d = d_buf[:r]
            _row_backward(backend, y, bwd_ids[sl], stats, coef[sl],
                          None if gh_all is None else gh_all[sl], temperature, d)
            grads.add_chunk(sl, d, h, weight, first=r0 == 0)
    d_hidden, d_weight, d_bias = grads.finish()
    if d_hidden is not None:
        if rows is not None:
            d_hidden = d_hidden.new_zeros(hidden.shape).index_copy_(0, rows, d_hidden)
        d_hidden = all_reduce_(shard, d_hidden).to(hidden.dtype)
    return (logp, ent, lse, coef), (terms.weighted_loss, terms.kl, terms.ratio), (
        d_hidden, d_weight, d_bias)


def loss_grad(shard: VocabShard, head, ids, grpo_args, g_ent, needs, backend: str,
              temperature: float, compact: bool = True, coef=None) -> ThreePass:
    """One vocabulary-parallel three-pass call; arguments and result as
    `ops.three_pass.loss_grad` (head: this rank's (hidden [N, D], weight [V_r, D], bias [V_r] |
    None); ids: global [N], checked by `agreement.agreed`). coef: None, or an earlier call's
    coefficients c [N] to form the gradients with (`_compute`'s given; the result's loss and
    GRPO terms are then not meaningful)."""
    hidden = head[0]
    N = hidden.shape[0]
    value_checks.check_finite_advantages(grpo_args[1])  # the same values on every rank
    rows = _rows(grpo_args[0], g_ent, compact)  # the same mask on every rank: the same rows
    with torch.no_grad():
        if rows is not None and rows.numel() == 0:  # every token masked: nothing to compute
            z = hidden.new_zeros(0, dtype=F32)
            stats, terms = (z,) * 4, (z,) * 3
            grads = tuple(torch.zeros_like(x) if x is not None and want else None
                          for x, want in zip(head, needs))
        else:
            def run(on: str):
                return _compute(shard, on, head, ids, grpo_args, g_ent, rows, needs,
                                temperature, coef)

            key = fallback.variant("linear-head", "vocab-parallel-three-pass", hidden.device,
                                   hidden.dtype)
            stats, terms, grads = (run("chunked") if backend == "chunked" else fallback.run(
                key, hidden.device, lambda: run("triton"), lambda: run("chunked")))
        full = lambda x, fill=0.0: _full(x, rows, N, fill)  # noqa: E731
        logp, ent, lse, coef = (full(x) for x in stats)
        lossw, kl, ratio = full(terms[0]), full(terms[1]), full(terms[2], 1.0)
        policy = lossw.sum()
        loss = policy.clone() if g_ent is None else policy + (g_ent * ent).sum()
    return ThreePass(loss, policy, logp, ent, kl, ratio, grads, lse, coef)


@torch.compiler.disable  # collectives and host reads: runs eagerly inside a compiled graph
def linear_grpo_loss(shard: VocabShard, head, ids, grpo_args, g_ent, backend: str,
                     temperature: float, logit_scale=None, compact: bool = True) -> ThreePass:
    """`ops.three_pass_op.linear_grpo_loss` on a vocabulary-parallel head: `ThreePass` with
    `loss` differentiable w.r.t. the local head's tensors that require grad (a second backward
    of a retained graph runs the passes again from the coefficients c: module docstring)."""
    if logit_scale is not None:  # s > 0 (the route's condition): a temperature
        temperature = temperature / float(logit_scale)
    needs = [t is not None and t.requires_grad for t in head]
    out = loss_grad(shard, head, ids, grpo_args, g_ent, needs, backend, temperature, compact)
    coef = out.coef

    def recompute(hidden, weight, bias):
        return loss_grad(shard, (hidden, weight, bias), ids, grpo_args, g_ent, needs, backend,
                         temperature, compact, coef=coef).grads

    saved = Saved(out.grads, recompute)
    value, out = out.loss, out._replace(grads=None)
    return out._replace(loss=ThreePassLoss.apply(value, *head, saved))
