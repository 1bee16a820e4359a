"""The functional API: selective log-probs and GRPO losses, from hidden states or from logits.

    selective_logprobs(hidden, weight, targets)          log p(target) of a linear head
    logprobs_from_logits(logits, targets)                log p(target) from logits
    fused_linear_grpo_loss(hidden, weight, ids, adv)     GRPO loss of a linear head
    grpo_loss(logits, ids, adv)                          GRPO loss from logits
    ...(..., return_token_values=True)                   and their per-token values, detached
    ...(..., return_terms=True)                          their differentiable per-token terms

None of them materializes full-vocabulary float32 logits. Each checks shapes and dtypes
(traceable by torch.compile) and calls a custom operator (`ops/custom_ops.py`,
`ops/three_pass_op.py`) on the backend of `ops/backends.py`. Every GRPO loss takes one route
(`loss_call.py`: three passes where a linear head's loss is a scalar with a gradient at token
level, four otherwise; `ops/route.py` decides), which the losses, the modules, the Hugging Face
helpers, grpo_train and the TRL trainer all reach.

The semantics are in docs/semantics.md.

Every function that computes logits takes `softcap` and `logit_scale` (keywords, None = off): the
logit transform some models apply inside their forward (Gemma 2's final-logit soft-capping,
Cohere's logit scale), from the raw logits y = hidden @ weight.T + bias (or the logits given):
z = softcap·tanh(logit_scale·y / softcap), then the temperature, z / τ, then the softmax
(docs/semantics.md, "Logit soft-capping and scale").

A packed batch (`cu_seqlens`, hidden [N, D] or logits [N, V]) takes the same routes: the kernels
see its N tokens, and `grpo_math` works on [N] with the segment sums of `token_layouts.py`.
"""

from __future__ import annotations

import torch

from . import parallel
from .loss_call import (
    GRPOTerms,
    as_btv,
    eager_inplace,
    finish,
    linear_call,
    linear_inputs,
    linear_loss,
    logits_call,
    vocab_parallel_call,
)
from .ops import forward_only, route
from .ops.backends import backend_for
from .ops.custom_ops import OPS, direct
from .option_checks import check_entropy_gather
from .params import GRPOParams, signature_with_params
from .validation import (
    check_flags,
    check_grad_filter,
    check_linear_head,
    check_logit_transform,
    check_logits,
    check_temperature,
    check_token_ids,
)

__all__ = ["GRPOTerms", "fused_linear_grpo_loss", "grpo_loss", "logprobs_from_logits",
           "selective_logprobs"]


# ---- selective log-probs ----------------------------------------------------------------------


def selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    return_entropy: bool = False,
    grad_filter: float | str | None = None,
    vocab_group=None,
):
    """Log-probability of `targets` under softmax(cap(s·(hidden @ weight.T + bias)) / temperature),
    cap(v) = softcap·tanh(v / softcap) (the identity when softcap is None), s = logit_scale (1
    when None).

    Never materializes the [..., V] logits. Differentiable w.r.t. hidden, weight and bias, through
    both outputs. Under torch.no_grad() (or with nothing requiring grad) it is the cheap scoring
    path for old/reference policies: on the Triton backend the forward-only route, per chunk of
    rows a library GEMM (cuBLAS) into float32 logits, then the Triton row forward
    (`ops/forward_only.py`; GRPO_KERNELS_THREE_PASS=0 keeps the fused forward kernel).

    Args:
        hidden: [..., D] float16/bfloat16/float32 hidden states.
        weight: [V, D] output-embedding (lm_head) weight, same dtype and device as hidden.
        targets: [...] integer token ids in [0, V).
        bias: optional [V] lm_head bias.
        temperature: logits are divided by it before the softmax (after the transform below).
        softcap: final-logit soft cap c > 0 (Gemma 2's `final_logit_softcapping`): the raw
            logits y become c·tanh(y / c) before the temperature. None: no cap.
        logit_scale: s != 0 (Cohere's `logit_scale`): y becomes s·y, before the cap if both are
            given (z = c·tanh(s·y / c)). None: no scale.
        return_entropy: also return the entropy of the full distribution (nats).
        grad_filter: None (default) for the exact backward. "auto" or an eps >= 0 turns on
            gradient filtering in the Triton backward: a [tokens × vocabulary] tile whose
            d logits are all <= eps × its token's gradient scale is skipped (approximate;
            "auto" = finfo(dtype).eps / 32, 2^-12 for bfloat16). Other backends stay exact.
        vocab_group: a vocabulary-parallel head (docs/integrations.md, "Tensor parallelism"):
            `weight` [V_r, D] and `bias` [V_r] are this rank's contiguous rows of the
            vocabulary, in the group's rank order, and targets are global ids; hidden and
            targets are the same on every rank. A DTensor weight sharded Shard(0) needs no
            vocab_group. Every rank gets the whole vocabulary's log-probs.

    Returns:
        logp [...] float32, and entropy [...] float32 if return_entropy.
    """
    def check(hidden, weight, bias):
        check_flags(return_entropy=return_entropy)
        check_linear_head(hidden, weight, bias)
        ids = check_token_ids("targets", targets, weight.shape[0], hidden.shape[:-1],
                              hidden.device, check_values=False)  # the op checks the range
        tau = check_temperature(temperature)
        return (tau, check_logit_transform(softcap, logit_scale, tau),
                ids.reshape(-1), check_grad_filter(grad_filter, hidden.dtype),
                linear_inputs(hidden.reshape(-1, hidden.shape[-1]), weight, bias))

    lead = hidden.shape[:-1]
    shard = None
    if parallel.is_vocab_parallel(weight, vocab_group):
        shard, weight, bias, hidden = parallel.local_head(weight, bias, vocab_group, hidden)
        shard, call = parallel.agreed(shard, lambda: check(hidden, weight, bias), lambda c:
                                      parallel.CallInputs(*c[4], c[2], {}, (*c[:2], c[3])),
                                      "targets")
    else:
        call = check(hidden, weight, bias)
    temperature, transform, ids, eps, head = call
    if shard is not None:
        route.vocab_parallel_logprobs_route(shard)
        logp, ent = parallel.linear_logprobs(shard, *head, ids, temperature, eps,
                                             backend_for(hidden), *transform)
    elif route.logprobs_route(*head, backend_for(hidden), direct(*head)).forward_only:
        logp, ent, _ = forward_only.linear_logprobs(*head, ids, temperature, "targets",
                                                    *transform)
    else:
        logp, ent, *_ = OPS.linear_logprobs(*head, ids, temperature, eps, backend_for(hidden),
                                           "targets", *transform)
    logp = logp.reshape(lead)
    return (logp, ent.reshape(lead)) if return_entropy else logp


def logprobs_from_logits(logits, targets, *, temperature=1.0, softcap=None, logit_scale=None,
                         return_entropy=False, inplace=False):
    """Log-probability of `targets` under softmax(cap(s·logits) / temperature), without a
    float32 [..., V] log-softmax (cap and s as in `selective_logprobs`; both off by default).

    Args:
        logits: [..., V] float16/bfloat16/float32 (read in its own dtype).
        targets: [...] integer ids in [0, V).
        temperature: logits are divided by it (after softcap and logit_scale).
        softcap, logit_scale: the logit transform z = softcap·tanh(logit_scale·logits /
            softcap) of `selective_logprobs`, for raw logits. A Hugging Face model's output
            logits are already capped and scaled: leave both None for those.
        return_entropy: also return the entropy (nats) of each distribution.
        inplace: backward writes d logits over `logits` (saves one [..., V] buffer; `logits`
            holds its gradient afterwards and must not be used again).

    Returns:
        logp [...] float32 (and entropy [...] float32); differentiable w.r.t. logits.
    """
    check_flags(return_entropy=return_entropy, inplace=inplace)
    check_logits(logits)
    temperature = check_temperature(temperature)
    transform = check_logit_transform(softcap, logit_scale, temperature)
    lead = logits.shape[:-1]
    ids = check_token_ids("targets", targets, logits.shape[-1], lead, logits.device,
                          "logits.shape[-1]", check_values=False,  # the op checks the range
                          source="logits")
    x = as_btv(logits)
    logp, ent, *_ = OPS.logits_logprobs(x, ids.reshape(-1), temperature, backend_for(x),
                                        "targets", eager_inplace(inplace), *transform)
    logp = logp.reshape(lead)
    return (logp, ent.reshape(lead)) if return_entropy else logp


# ---- GRPO losses ------------------------------------------------------------------------------


@signature_with_params
def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    grad_filter: float | str | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    sampling_logps: torch.Tensor | None = None,
    return_terms: bool = False,
    return_token_values: bool = False,
    entropy_gather=None,
    vocab_group=None,
    params: GRPOParams | None = None,
    **hyperparameters,
) -> tuple:
    """GRPO loss (docs/semantics.md, TRL semantics) from hidden states and the lm_head weight.

    Args:
        hidden: [B, T, D] hidden states; hidden[b, t] predicts completion_ids[b, t].
        weight, bias: [V, D] lm_head weight (hidden's dtype, or float32: mixed), [V] or None.
        completion_ids: [B, T] token ids in [0, V).
        advantages: [B], [B, 1] or [B, T], finite.
        completion_mask: [B, T], 1 for real completion tokens (default: all ones).
        old_logps: [B, T] log-probs under the sampling policy (default: logp.detach()).
        ref_logps: [B, T] log-probs under the reference policy; required when beta != 0.
        num_items_in_batch: dapo/cispo/vespo's normalizer (default: the mask's token count):
            a finite number > 0, or a one-element tensor holding one (on any device).
        importance_sampling_ratio: [B], [B, 1] or [B, T] rollout-engine correction.
        cu_seqlens: a packed batch of S sequences (docs/semantics.md, "Packed batches"):
            int32/int64 [S + 1], sequence s holds tokens cu_seqlens[s]:cu_seqlens[s+1]. Then
            hidden is [N, D], completion_ids, old/ref log-probs (and mask, optional) are [N],
            advantages and importance_sampling_ratio [S], [S, 1] or [N]. Equals the padded call.
        grad_filter: None (exact, default), "auto" or eps >= 0: gradient filtering in the
            Triton backward (approximate; see `selective_logprobs`).
        softcap: the model's final-logit soft cap c > 0 (Gemma 2), or None. The policy's
            logits are z = c·tanh(s·y / c) of the raw y = hidden @ weight.T + bias, then
            divided by the temperature (as the model's forward, then TRL, compute them).
        logit_scale: the model's logit scale s != 0 (Cohere: z = s·y), or None; applied
            before the cap when both are given. Both are properties of the model, not GRPO
            hyperparameters: old_logps / ref_logps must come from the same transform.
        sampling_logps: [B, T] log-probs under the sampling engine, for the off-policy mask
            (off_policy_mask_threshold; default: old_logps); NaN marks an unscored token.
        return_terms: return the differentiable per-token terms (`GRPOTerms`: Σ weight·ℓ
            without the entropy bonus, per-token logp, entropy, ratio, kl, vespo's φ, the
            entropy mask) instead of (loss, metrics); always the four-pass route.
        return_token_values: (loss, metrics, the same GRPOTerms detached): the loss on the
            fastest route and the per-token values, to be read where the mask is 1.
        entropy_gather: with top_entropy_quantile < 1, a function that gathers the entropies
            of every process (see `grpo_options.high_entropy_mask`); default: this batch's.
        vocab_group: a vocabulary-parallel head (docs/integrations.md, "Tensor parallelism"):
            weight [V_r, D], bias [V_r] are this rank's rows, as `selective_logprobs` takes
            them; every other input is the same on every rank. Loss and metrics are the whole
            head's, on every rank.
        params: a GRPOParams, or the hyperparameters as keywords (GRPOParams' fields: beta,
            epsilon_low, epsilon_high, delta, temperature, loss_type, ...), not both.

    Returns:
        (loss: 0-dim float32, metrics: dict of detached 0-dim float32 tensors); with
        return_token_values, (loss, metrics, GRPOTerms detached); with return_terms, GRPOTerms
    """
    params, bad = _resolve(params, hyperparameters, weight, vocab_group)

    def check(hidden, weight, bias):
        if bad is not None:
            raise bad
        check_flags(return_terms=return_terms, return_token_values=return_token_values)
        check_entropy_gather(entropy_gather)
        return linear_call(hidden, weight, completion_ids, advantages, completion_mask,
                           old_logps, ref_logps, bias, num_items_in_batch,
                           importance_sampling_ratio, cu_seqlens, grad_filter, params,
                           sampling_logps, softcap, logit_scale)

    shard, call = vocab_parallel_call(check, hidden, weight, bias, vocab_group,
                                      (params, return_terms, return_token_values))
    return linear_loss(call, params, entropy_gather, return_terms=return_terms,
                       return_token_values=return_token_values, shard=shard)


def _resolve(params, hyperparameters: dict, weight, vocab_group) -> tuple:
    """(GRPOParams, None), or for a vocabulary-parallel head whose hyperparameters this rank
    rejects, (None, the error), raised in the ranks' agreement: every rank raises, none waits
    for another."""
    try:
        return GRPOParams.resolve(params, hyperparameters), None
    except (TypeError, ValueError) as exc:
        if not parallel.is_vocab_parallel(weight, vocab_group):
            raise
        return None, exc


@signature_with_params
def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    inplace: bool = False,
    softcap: float | None = None,
    logit_scale: float | None = None,
    sampling_logps: torch.Tensor | None = None,
    return_terms: bool = False,
    return_token_values: bool = False,
    entropy_gather=None,
    params: GRPOParams | None = None,
    **hyperparameters,
) -> tuple:
    """GRPO loss (docs/semantics.md) from logits [B, T, V]; logits[b, t] predicts
    completion_ids[b, t]. Nothing of [B, T, V] float32 is allocated: logits are read in their
    own dtype, and views sliced out of a model's output are read in place.

    Arguments as `fused_linear_grpo_loss` (a packed batch: logits [N, V] with `cu_seqlens`);
    `inplace=True` writes d logits over the logits buffer in backward (the logits are garbage
    afterwards): it saves the allocation of d logits, not the whole output's gradient that a
    slice's backward allocates after it, nor a leaf's .grad (a copy; docs/semantics.md).
    `softcap` / `logit_scale` transform the logits given, as in
    `fused_linear_grpo_loss`: for raw logits only (a Hugging Face model's output logits are
    already capped and scaled). return_token_values / return_terms: as in
    `fused_linear_grpo_loss`.

    Returns:
        (loss: 0-dim float32, metrics: dict of detached 0-dim float32 tensors); with
        return_token_values, (loss, metrics, GRPOTerms detached); with return_terms, GRPOTerms
    """
    check_flags(inplace=inplace, return_terms=return_terms,
                return_token_values=return_token_values)
    check_entropy_gather(entropy_gather)
    params = GRPOParams.resolve(params, hyperparameters)
    terms, inputs = logits_call(logits, completion_ids, advantages, completion_mask, old_logps,
                                ref_logps, num_items_in_batch, importance_sampling_ratio,
                                cu_seqlens, inplace, params, sampling_logps, entropy_gather,
                                softcap, logit_scale)
    return finish(terms, inputs, params, return_terms=return_terms,
                  return_token_values=return_token_values)
