"""The TRL subclass's loss calls: the fused loss on TRL's padded micro-batch
(`padded_grpo_loss`) or on its packed rows (`packed_grpo_loss`), each returning the loss, TRL's
loss type, normalizer and entropy bonus computed inside it (so that token-level losses take the
three-pass route), and the detached per-token values TRL's metrics read; and `policy_terms`, the
differentiable per-token terms for a trainer that forms its own loss from them.
"""

from __future__ import annotations

import torch

from ..functional import fused_linear_grpo_loss
from ..params import GRPOParams

__all__ = ["packed_grpo_loss", "padded_grpo_loss", "policy_terms"]


def policy_terms(hidden, weight, bias, completion_ids, mask, advantages, old_logps, ref_logps,
                 params: GRPOParams, num_items_in_batch=None, importance_sampling_ratio=None,
                 grad_filter=None, sampling_logps=None, softcap=None, logit_scale=None):
    """The GRPO policy loss with differentiable per-token values, for a trainer that forms its
    own loss from them (`fused_linear_grpo_loss(..., return_terms=True)`: the four-pass route,
    no [N, V] logits); params.entropy_coef is ignored.
    hidden [B, T, D], weight [V, D], bias [V] | None, completion_ids/mask [B, T].
    Returns (Σ weight·ℓ: 0-dim float32, entropy [B, T] (differentiable), ratio [B, T] or [B, 1]
    (detached), kl [B, T] (detached) or None). grad_filter, softcap, logit_scale: see
    `selective_logprobs` (`grpo_kernels.hf.logit_transform(model)` gives a model's).
    """
    check_hidden(hidden)
    terms = fused_linear_grpo_loss(hidden, weight, completion_ids, advantages, mask, old_logps,
                                   ref_logps, bias, num_items_in_batch=num_items_in_batch,
                                   importance_sampling_ratio=importance_sampling_ratio,
                                   grad_filter=grad_filter, sampling_logps=sampling_logps,
                                   return_terms=True, softcap=softcap, logit_scale=logit_scale,
                                   params=params)
    return terms.policy_loss, terms.entropy, terms.ratio, terms.kl


def check_hidden(hidden) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, D], got {getattr(hidden, 'shape', hidden)}")


def padded_grpo_loss(hidden, weight, bias, completion_ids, mask, advantages, old_logps, ref_logps,
               params: GRPOParams, num_items_in_batch=None, importance_sampling_ratio=None,
               grad_filter=None, sampling_logps=None, entropy_gather=None, softcap=None,
               logit_scale=None):
    """The trainer's loss on padded rows: (loss, entropy bonus of params.entropy_coef included,
    the detached GRPOTerms for TRL's metrics), by the route every loss takes
    (`fused_linear_grpo_loss(..., return_token_values=True)`: the three-pass route where it
    applies)."""
    check_hidden(hidden)
    loss, _, terms = fused_linear_grpo_loss(
        hidden, weight, completion_ids, advantages, mask, old_logps, ref_logps, bias,
        num_items_in_batch=num_items_in_batch,
        importance_sampling_ratio=importance_sampling_ratio, grad_filter=grad_filter,
        sampling_logps=sampling_logps, return_token_values=True, entropy_gather=entropy_gather,
        softcap=softcap, logit_scale=logit_scale, params=params)
    return loss, terms


def packed_grpo_loss(packed, hidden, weight, bias, completion_ids, mask, advantages, old_logps,
                     ref_logps, params, num_items_in_batch=None, importance_sampling_ratio=None,
                     grad_filter=None, sampling_logps=None, entropy_gather=None, **transform):
    """The fused loss on the packed tokens: TRL's per-token inputs [S, T] packed to the N kept
    tokens (`packed.pack`; per-sequence values [S] / [S, 1] stay), the head on hidden [N, D]
    with packed.cu_seqlens. Returns (loss, the detached GRPOTerms with their per-token values
    back on the [S, T] grid) (zero at the tokens the rows do not hold, which TRL's mask
    already excludes) for TRL's metrics. Equals the fused loss on the grid: the tokens left out
    are masked there. mask: TRL's loss mask (completion mask times tool mask), 0 allowed at
    kept tokens."""
    S, T = packed.shape

    def per_token(x):  # [S, T] -> [N]; per-sequence values as they are
        return packed.pack(x) if x is not None and tuple(x.shape) == (S, T) and T > 1 else x

    loss, _, terms = fused_linear_grpo_loss(
        hidden, weight, packed.pack(completion_ids), per_token(advantages), packed.pack(mask),
        packed.pack(old_logps), packed.pack(ref_logps), bias,
        num_items_in_batch=num_items_in_batch,
        importance_sampling_ratio=per_token(importance_sampling_ratio),
        cu_seqlens=packed.cu_seqlens.to(hidden.device), grad_filter=grad_filter,
        sampling_logps=packed.pack(sampling_logps), return_token_values=True,
        entropy_gather=entropy_gather, params=params, **transform)
    N = hidden.shape[0]

    def grid(x):  # per-token [N] -> [S, T]; per-sequence [S, 1] and None as they are
        if x is None or x.dim() != 1 or x.shape[0] != N:
            return x
        return packed.unpack(x)

    # every per-token value, vespo's φ included (per token where the advantages are [S, T])
    return loss, terms._replace(logp=grid(terms.logp), entropy=grid(terms.entropy),
                                ratio=grid(terms.ratio), kl=grid(terms.kl),
                                vespo_phi=grid(terms.vespo_phi),
                                entropy_mask=grid(terms.entropy_mask))
