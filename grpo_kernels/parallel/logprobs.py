"""Selective log-probs of a vocabulary-parallel head, differentiable: the four-pass route.

    forward   this rank's launcher forward over its rows [V_r, D] (the backend's, Triton or
              chunked, with its fallback): lse_r, H_r, the log-prob of the local target id and
              S_r = Σ 2^(z·log2(e) - r_r) against r_r = lse_r·log2(e) (the chunked launcher's
              `lse_sum`; 1 on Triton), then one all-gather of [4, N] (`combine.py`): logp, H,
              lse of the whole vocabulary and p's reference (M, S), equal on every rank
    backward  this rank's launcher backward from the global lse, H, logp and S' = Σ_v
              2^(z_v·log2(e) - r) (`Stats.lse_sum_at`): its d-logits p_v·(...) with
              p_v = 2^(z_v·log2(e) - r) / S' on its own columns (float32's precision at a
              dominant token, where e^{z - lse} would carry the lse's rounding), and the
              target's term, from logp, only where the target is its own (ids outside the shard
              are -1); d W and d bias stay local, and the d hidden partial sums are all-reduced
              over the group: the column-parallel linear's own backward, so d hidden is what the
              whole head gives

No rank holds [N, V] logits; the launchers hold [tokens x vocabulary] tiles of their own shard.
Collectives: the all-gather of 4·N float64 per rank in the forward, an all-reduce of [N, D] in
the backward (hidden's dtype) when hidden requires grad.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..chunked.tiles import compute_dtype
from ..ops.backends import IMPLS
from ..ops.launch import LinearHeadOp
from .combine import all_reduce_, combine, lse_reference, shard_targets
from .shard import VocabShard


class VocabParallelLogprobs(torch.autograd.Function):
    """(logp [N], entropy [N]) float32 of the whole vocabulary, from hidden [N, D] and this
    rank's weight [V_r, D] and bias [V_r] | None; `shard` says where its rows lie."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, shard: VocabShard, op: LinearHeadOp):
        fwd_ids, bwd_ids, owner = shard_targets(ids, shard)
        stats = shard_forward(op, (hidden, weight, bias), fwd_ids, shard, owner)
        ctx.set_materialize_grads(False)
        # logp saved as a copy: the caller may change the output in place
        ctx.save_for_backward(hidden, weight, bias, bwd_ids, stats[0].clone(), *stats[1:])
        ctx.shard, ctx.op = shard, op
        return stats[0], stats[1]

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, bwd_ids, *stats = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:3]]
        if (g_logp is None and g_ent is None) or not any(needs):
            return (None,) * 6
        g_logp = torch.zeros_like(stats[0]) if g_logp is None else g_logp.float().contiguous()
        grads = backward(ctx.op, ctx.shard, (hidden, weight, bias), bwd_ids, stats, g_logp,
                         None if g_ent is None else g_ent.float().contiguous(), needs)
        return (*grads, None, None, None)


def shard_forward(op: LinearHeadOp, head, fwd_ids, shard: VocabShard, owner) -> tuple:
    """(logp, entropy, lse, lse_sum) [N] float32 of the whole vocabulary: this rank's launcher
    forward, then `combine`; lse_sum is the S' its backward reads p with (`Stats.lse_sum_at`,
    against r as the launcher's compute dtype forms it)."""
    lse_sum_r = head[0].new_ones(head[0].shape[0], dtype=torch.float32)  # 1: not written
    logp_r, ent_r, lse_r = op.forward(fwd_ids, None, *head, lse_sum=lse_sum_r)
    dtype = compute_dtype(*head)
    stats = combine(shard, lse_reference(lse_r, dtype), lse_sum_r, logp_r, ent_r, owner)
    return stats.logp, stats.entropy, stats.lse, stats.lse_sum_at(dtype)


def backward(op: LinearHeadOp, shard: VocabShard, head, bwd_ids, stats, g_logp, g_ent,
             needs) -> tuple:
    """(d hidden summed over the group, d weight [V_r, D], d bias [V_r]) of Σ g_logp·logp +
    Σ g_ent·H, from the whole vocabulary's (logp, entropy, lse, lse_sum) [N] (`shard_forward`);
    None where not needed.

    A mixed head (16-bit hidden, float32 weight) on the chunked backend, which computes in
    float32 either way, runs its backward on the hidden states as float32 (the same values, so
    the same logits): the partial sums of d hidden then travel and add up in float32 and are
    rounded to hidden's dtype once, as the whole head rounds them. On Triton the mixed kernels
    keep the 16-bit tensor cores, and the partial sums travel in hidden's dtype (one more
    rounding of d hidden per rank), as do a 16-bit head's."""
    hidden, weight, bias = head
    dtype = hidden.dtype
    if dtype != weight.dtype and needs[0] and not op.on_triton:
        head = (hidden.float(), weight, bias)
    logp, ent, lse, lse_sum = stats
    grads = op.backward(head, bwd_ids, lse, ent, g_logp, g_ent, needs, shard_targets=True,
                        logp=logp, lse_sum=lse_sum)
    grads = tuple(g if need else None for g, need in zip(grads, needs))
    d_hidden = all_reduce_(shard, grads[0])
    return (None if d_hidden is None else d_hidden.to(dtype), *grads[1:])


def head_op(backend: str, temperature: float, grad_filter=None, softcap=None,
            logit_scale=None) -> LinearHeadOp:
    """The launchers of `backend` bound to the call's options (Triton goes through the
    fallback of `ops/fallback.py`)."""
    return LinearHeadOp(IMPLS[backend], temperature, grad_filter, softcap, logit_scale)


@torch.compiler.disable  # collectives and a host read: runs eagerly inside a compiled graph
def linear_logprobs(shard: VocabShard, hidden, weight, bias, ids, temperature: float,
                    grad_filter, backend: str, softcap=None, logit_scale=None):
    """(logp [N], entropy [N]) float32 of the whole vocabulary for global ids [N] int64 (range
    checked by `agreement.agreed`), differentiable w.r.t. hidden [N, D] and the local
    weight [V_r, D] and bias [V_r]."""
    op = head_op(backend, temperature, grad_filter, softcap, logit_scale)
    return VocabParallelLogprobs.apply(hidden, weight, bias, ids, shard, op)
