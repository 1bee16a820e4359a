"""The functional API: selective log-probs and GRPO losses, from hidden states or from logits.

    selective_logprobs(hidden, weight, targets)          log p(target) of a linear head
    logprobs_from_logits(logits, targets)                log p(target) from logits
    fused_linear_grpo_loss(hidden, weight, ids, adv)     GRPO loss of a linear head
    grpo_loss(logits, ids, adv)                          GRPO loss from logits
    ...(..., return_terms=True)                          their per-token terms (GRPOTerms)

None of them materializes full-vocabulary float32 logits. Each checks shapes and dtypes here
(traceable by torch.compile) and calls a custom operator (`ops/custom_ops.py`) on the backend of
`ops/backends.py`. Every GRPO loss takes one route (`_linear_route`, `_logits_route`), which the
losses, the modules, the Hugging Face helpers and the TRL trainer all reach:

    token-level importance sampling on Triton: the token-terms op, whose forward kernel runs the
        GRPO epilogue and returns weight·ℓ per token (`kernels/epilogue.py`);
    a linear head's scalar loss that needs a gradient, at token level: the three-pass route,
        the gradient formed in the forward (`ops/three_pass.py`; `ops/route.py` says when);
    sequence-level (GSPO) ratios and the options that need whole sequences or the batch (vespo,
        the off-policy mask, the entropy quantile; `grpo_options`), and the chunked PyTorch
        backend: the selective log-prob op, then `grpo_math.policy_loss` around it;
    then Σ weight·ℓ, the entropy bonus and the metrics in PyTorch (`grpo_math.finish_loss`).

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

import functools
from typing import NamedTuple

import torch

from . import parallel
from .grpo_math import entropy_bonus_weights, finish_loss, grpo_metrics, policy_loss, token_weights
from .ops import route, three_pass_op
from .ops.backends import backend_for
from .ops.custom_ops import OPS
from .params import GRPOParams, signature_with_params
from .token_layouts import layout_of
from .validation import (
    LossInputs,
    check_finite_advantages,
    check_grad_filter,
    check_linear_head,
    check_linear_loss_inputs,
    check_logit_transform,
    check_logits,
    check_logits_loss_inputs,
    check_temperature,
    check_token_ids,
)


def _linear_inputs(hidden, weight, bias):
    """The tensors the linear-head kernels take: contiguous hidden [N, D], weight, bias."""
    return hidden.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous()


def _as_btv(logits: torch.Tensor) -> torch.Tensor:
    """A [B, T, V] view (a copy only if the layout forbids one) with a unit-stride last dim."""
    if logits.dim() == 1:
        logits = logits.reshape(1, 1, -1)
    elif logits.dim() == 2:
        logits = logits.unsqueeze(0)
    elif logits.dim() > 3:
        logits = logits.reshape(-1, *logits.shape[-2:])
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _eager(inplace: bool) -> bool:
    """`inplace` holds in eager mode; a compiled graph allocates d logits itself (an in-place
    write into a forward input from the backward graph is not something it can express)."""
    return bool(inplace) and not torch.compiler.is_compiling()


class GRPOTerms(NamedTuple):
    """The per-token results of the GRPO route: what the losses aggregate and what a trainer
    logs. Per-token values are [B, T] (packed: [N]); per-sequence ones [B, 1] (packed: [S, 1])."""

    policy_loss: torch.Tensor  # Σ weight·ℓ, 0-dim float32 (no entropy bonus), differentiable
    logp: torch.Tensor  # per token, float32, differentiable
    entropy: torch.Tensor  # per token, float32, differentiable
    ratio: torch.Tensor  # importance ratio w, detached: per token, or per sequence (GSPO)
    kl: torch.Tensor | None  # k3 KL per token, detached; None when beta == 0
    vespo_phi: torch.Tensor | None = None  # vespo's φ per sequence, detached; else None
    entropy_mask: torch.Tensor | None = None  # top_entropy_quantile < 1: kept tokens (0/1)


def _takes_terms_op(backend: str, params: GRPOParams) -> bool:
    """Does the call take the token-terms op (the GRPO epilogue inside the forward kernel)?
    Not for options that need a whole sequence or the batch before any token's loss."""
    return backend == "triton" and not params.needs_whole_sequences


def _terms_args(inputs: LossInputs, params: GRPOParams) -> tuple:
    """A token-terms op's GRPO arguments: [N] float32 weights, advantages, old/ref log-probs
    and rollout ratios in the kernels' token order, then what the per-token loss reads
    (TokenLossArgs, the only hyperparameters an op takes)."""
    layout = layout_of(inputs.mask, inputs.cu_seqlens)
    weights = token_weights(inputs.mask, params, inputs.num_items_in_batch, layout)
    flat = lambda x: None if x is None else layout.flat(x)  # noqa: E731
    return (flat(weights), flat(inputs.advantages), flat(inputs.old_logps),
            flat(inputs.ref_logps), flat(inputs.importance_sampling_ratio),
            *params.token_loss_args.to_op_args())


def _terms_from_op(outputs, inputs: LossInputs, params: GRPOParams) -> GRPOTerms:
    """GRPOTerms from a token-terms op's [N] outputs."""
    logp, ent, _, token_loss, _, kl, ratio = outputs
    shape = inputs.mask.shape  # [B, T], or [N] packed
    return GRPOTerms(token_loss.sum(), logp.reshape(shape), ent.reshape(shape),
                     ratio.reshape(shape), kl.reshape(shape) if params.beta != 0.0 else None)


def _unfused_terms(logp, ent, inputs: LossInputs, params: GRPOParams,
                   entropy_gather=None) -> GRPOTerms:
    """Sequence-level ratios, the whole-sequence options, or the chunked PyTorch backend: the
    differentiable log-probs [N] of the selective op (which checks the token ids) go through
    `grpo_math` on [B, T] (or [N] packed) (traceable)."""
    check_finite_advantages(inputs.advantages)  # in-graph under torch.compile
    shape = inputs.mask.shape  # [B, T], or [N] packed
    logp, ent = logp.reshape(shape), ent.reshape(shape)
    t = policy_loss(logp, inputs, params, entropy=ent, entropy_gather=entropy_gather)
    return GRPOTerms(t.loss, logp, ent, t.ratio, t.kl, t.vespo_phi, t.entropy_mask)


def _loss_and_metrics(terms: GRPOTerms, inputs: LossInputs, params: GRPOParams):
    return finish_loss(terms.policy_loss, terms.entropy, terms.ratio, terms.kl, inputs, params,
                       vespo_phi=terms.vespo_phi, entropy_mask=terms.entropy_mask)


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
    both outputs. Under torch.no_grad() it is the cheap scoring path for old/reference policies.

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
        check_linear_head(hidden, weight, bias)
        ids = check_token_ids("targets", targets, weight.shape[0], hidden.shape[:-1],
                              hidden.device, check_values=False)  # the op checks the range
        return (check_temperature(temperature), check_logit_transform(softcap, logit_scale),
                ids.reshape(-1), check_grad_filter(grad_filter, hidden.dtype),
                _linear_inputs(hidden.reshape(-1, hidden.shape[-1]), weight, bias))

    lead = hidden.shape[:-1]
    shard = None
    if parallel.is_vocab_parallel(weight, vocab_group):
        shard, weight, bias, hidden = parallel.local_head(weight, bias, vocab_group, hidden)
        shard, call = parallel.agreed(shard, lambda: check(hidden, weight, bias), lambda c:
                                      parallel.CallInputs(*c[4], c[2], {}), "targets")
    else:
        call = check(hidden, weight, bias)
    temperature, transform, ids, eps, head = call
    if shard is not None:
        logp, ent = parallel.linear_logprobs(shard, *head, ids, temperature, eps,
                                             backend_for(hidden), *transform)
    else:
        logp, ent, _ = OPS.linear_logprobs(*head, ids, temperature, eps, backend_for(hidden),
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
    check_logits(logits)
    temperature = check_temperature(temperature)
    transform = check_logit_transform(softcap, logit_scale)
    lead = logits.shape[:-1]
    ids = check_token_ids("targets", targets, logits.shape[-1], lead, logits.device,
                          "logits.shape[-1]", check_values=False)  # the op checks the range
    x = _as_btv(logits)
    logp, ent, _ = OPS.logits_logprobs(x, ids.reshape(-1), temperature, backend_for(x),
                                       "targets", _eager(inplace), *transform)
    logp = logp.reshape(lead)
    return (logp, ent.reshape(lead)) if return_entropy else logp


# ---- GRPO losses ------------------------------------------------------------------------------


def _linear_route(hidden, weight, completion_ids, advantages, completion_mask, old_logps,
                  ref_logps, bias, num_items_in_batch, importance_sampling_ratio, cu_seqlens,
                  grad_filter, params: GRPOParams, sampling_logps=None, softcap=None,
                  logit_scale=None) -> tuple:
    """The route of every linear-head GRPO loss: these checks (shapes and dtypes; traceable),
    then the three-pass path (`ops/three_pass.py`) or `_linear_terms`. Returns the checked call:
    (ids [N], inputs, grad_filter's eps, backend, head = contiguous (hidden [N, D], weight
    [V, D], bias [V] | None), transform = (softcap, logit_scale))."""
    transform = check_logit_transform(softcap, logit_scale)
    ids, inputs = check_linear_loss_inputs(hidden, weight, bias, completion_ids, params,
                                           completion_mask, advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False,  # the op checks values
                                           cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    eps = check_grad_filter(grad_filter, hidden.dtype)
    head = _linear_inputs(hidden.reshape(-1, hidden.shape[-1]), weight, bias)  # [N, D]
    return ids.reshape(-1), inputs, eps, backend_for(hidden), head, transform


def _linear_terms(call: tuple, params: GRPOParams, entropy_gather=None,
                  shard=None) -> GRPOTerms:
    """The token-terms op, or the selective log-prob op with grpo_math, on a checked call
    (shard: a vocabulary-parallel head's, whose log-probs come from `parallel`)."""
    ids, inputs, eps, backend, head, transform = call
    if shard is not None:
        logp, ent = parallel.linear_logprobs(shard, *head, ids, params.temperature, eps,
                                             backend, *transform)
        return _unfused_terms(logp, ent, inputs, params, entropy_gather)
    if _takes_terms_op(backend, params):
        outputs = OPS.linear_grpo_terms(*head, ids, params.temperature, eps, backend,
                                        *_terms_args(inputs, params), *transform)
        return _terms_from_op(outputs, inputs, params)
    logp, ent, _ = OPS.linear_logprobs(*head, ids, params.temperature, eps, backend,
                                       "completion_ids", *transform)
    return _unfused_terms(logp, ent, inputs, params, entropy_gather)


def _three_pass_loss(call: tuple, params: GRPOParams, shard=None) -> tuple:
    """(loss, metrics, detached GRPOTerms) of a checked call on the three-pass route (shard: a
    vocabulary-parallel head's, computed by `parallel.linear_grpo_loss`)."""
    ids, inputs, _, backend, head, (_, logit_scale) = call
    g_ent = None
    if params.entropy_coef != 0.0:  # the bonus's d(loss)/d entropy per token
        g_ent = entropy_bonus_weights(inputs.mask, params.entropy_coef).reshape(-1)
    # a packed CUDA batch is not compacted: counting its masked tokens would read the device
    compact = inputs.cu_seqlens is None or head[0].device.type != "cuda"
    loss_grad = three_pass_op.linear_grpo_loss
    if shard is not None:
        loss_grad = functools.partial(parallel.linear_grpo_loss, shard)
    out = loss_grad(head, ids, _terms_args(inputs, params), g_ent, backend, params.temperature,
                    logit_scale, compact)
    shape = inputs.mask.shape  # [B, T], or [N] packed
    ent, ratio = out.entropy.reshape(shape), out.ratio.reshape(shape)
    kl = None if params.beta == 0.0 else out.kl.reshape(shape)
    metrics = grpo_metrics(ent, ratio, kl, inputs.advantages, inputs.mask, params,
                           layout_of(inputs.mask, inputs.cu_seqlens), old_logps=inputs.old_logps)
    return out.loss, metrics, GRPOTerms(out.policy, out.logp.reshape(shape), ent, ratio, kl)


def _vocab_parallel_route(check, hidden, weight, bias, vocab_group) -> tuple:
    """(None, check(hidden, weight, bias)) for a whole head; for a vocabulary-parallel one
    (a DTensor weight or vocab_group=, `parallel`), (its VocabShard, the checked call on the
    local tensors) once every rank of the group agrees on its inputs (else the same error on
    every rank)."""
    if not parallel.is_vocab_parallel(weight, vocab_group):
        return None, check(hidden, weight, bias)
    shard, weight, bias, hidden = parallel.local_head(weight, bias, vocab_group, hidden)

    def inputs_of(call):
        ids, inputs, *_ = call
        per_token = {k: getattr(inputs, k) for k in (
            "mask", "advantages", "old_logps", "ref_logps", "importance_sampling_ratio",
            "num_items_in_batch", "cu_seqlens", "sampling_logps")}
        return parallel.CallInputs(*call[4], ids, per_token)

    return parallel.agreed(shard, lambda: check(hidden, weight, bias), inputs_of,
                           "completion_ids")


def _detached(terms: GRPOTerms) -> GRPOTerms:
    return GRPOTerms(*(None if x is None else x.detach() for x in terms))


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
        weight: [V, D] lm_head weight (hidden's dtype, or float32 under 16-bit hidden);
            bias: optional [V].
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
        return_terms: return the per-token terms (`GRPOTerms`: the policy loss Σ weight·ℓ
            without the entropy bonus, and per-token logp, entropy, ratio and kl, with vespo's φ
            and the entropy mask) instead of (loss, metrics), for a trainer that aggregates or
            logs them its own way; params.entropy_coef is then not applied. The loss then takes
            the four-pass route (docs/internals.md, "Routes").
        return_token_values: also return the per-token values, detached (`GRPOTerms` with
            no gradient anywhere), beside the loss and metrics: for a trainer that logs them
            its own way while the loss, entropy bonus included, is this function's, on the
            fastest route the call allows.
        entropy_gather: with top_entropy_quantile < 1, a function that gathers the entropies
            of every process (see `grpo_options.high_entropy_mask`); default: this batch's.
        vocab_group: a vocabulary-parallel head (tensor parallelism; docs/integrations.md):
            weight [V_r, D] and bias [V_r] are this rank's contiguous rows of the vocabulary
            in the group's rank order, completion_ids are global ids, and every other input is
            the same on every rank of the group. A DTensor weight (and bias) sharded Shard(0)
            needs no vocab_group. Loss and metrics are then the whole head's, on every rank.
        params: a GRPOParams, or the hyperparameters as keywords (GRPOParams' fields: beta,
            epsilon_low, epsilon_high, delta, temperature, loss_type, ...), not both.

    Returns:
        (loss: 0-dim float32, metrics: dict of detached 0-dim float32 tensors); with
        return_token_values, (loss, metrics, GRPOTerms detached); with return_terms, GRPOTerms
    """
    params = GRPOParams.resolve(params, hyperparameters)
    if return_terms and return_token_values:
        raise ValueError("return_terms (differentiable per-token terms) and return_token_values "
                         "(detached ones beside the loss) exclude each other; ask for one")

    def check(hidden, weight, bias):
        return _linear_route(hidden, weight, completion_ids, advantages, completion_mask,
                             old_logps, ref_logps, bias, num_items_in_batch,
                             importance_sampling_ratio, cu_seqlens, grad_filter, params,
                             sampling_logps, softcap, logit_scale)

    shard, call = _vocab_parallel_route(check, hidden, weight, bias, vocab_group)
    _, inputs, eps, backend, head, (softcap, scale) = call
    if route.linear_loss_route(*head, backend, params, softcap, eps,
                               per_token_outputs=return_terms, vocab_parallel=shard,
                               logit_scale=scale).three_pass:
        loss, metrics, terms = _three_pass_loss(call, params, shard)
        return (loss, metrics, terms) if return_token_values else (loss, metrics)
    terms = _linear_terms(call, params, entropy_gather, shard)
    if return_terms:
        return terms
    loss, metrics = _loss_and_metrics(terms, inputs, params)
    return (loss, metrics, _detached(terms)) if return_token_values else (loss, metrics)


def _logits_route(logits, completion_ids, advantages, completion_mask, old_logps, ref_logps,
                  num_items_in_batch, importance_sampling_ratio, cu_seqlens, inplace,
                  params: GRPOParams, sampling_logps=None, entropy_gather=None,
                  softcap=None, logit_scale=None) -> tuple[GRPOTerms, LossInputs]:
    """The route of every logits-input GRPO loss (see `_linear_route`)."""
    transform = check_logit_transform(softcap, logit_scale)
    ids, inputs = check_logits_loss_inputs(logits, completion_ids, params, completion_mask,
                                           advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False,  # the op checks values
                                           cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    x = _as_btv(logits)  # [N, V] -> [1, N, V]
    backend = backend_for(x)
    if _takes_terms_op(backend, params):
        outputs = OPS.logits_grpo_terms(x, ids.reshape(-1), params.temperature, backend,
                                        _eager(inplace), *_terms_args(inputs, params),
                                        *transform)
        return _terms_from_op(outputs, inputs, params), inputs
    logp, ent, _ = OPS.logits_logprobs(x, ids.reshape(-1), params.temperature, backend,
                                       "completion_ids", _eager(inplace), *transform)
    return _unfused_terms(logp, ent, inputs, params, entropy_gather), inputs


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
    entropy_gather=None,
    params: GRPOParams | None = None,
    **hyperparameters,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | GRPOTerms:
    """GRPO loss (docs/semantics.md) from logits [B, T, V]; logits[b, t] predicts
    completion_ids[b, t]. Nothing of [B, T, V] float32 is allocated: logits are read in their
    own dtype, and views sliced out of a model's output are read in place.

    Arguments as `fused_linear_grpo_loss` (a packed batch: logits [N, V] with `cu_seqlens`);
    `inplace=True` writes d logits over the logits buffer in backward (the logits are garbage
    afterwards). `softcap` / `logit_scale` transform the logits given, as in
    `fused_linear_grpo_loss`: for raw logits only (a Hugging Face model's output logits are
    already capped and scaled).

    Returns:
        (loss: 0-dim float32, metrics: dict of detached 0-dim float32 tensors), or GRPOTerms
    """
    params = GRPOParams.resolve(params, hyperparameters)
    terms, inputs = _logits_route(logits, completion_ids, advantages, completion_mask, old_logps,
                                  ref_logps, num_items_in_batch, importance_sampling_ratio,
                                  cu_seqlens, inplace, params, sampling_logps, entropy_gather,
                                  softcap, logit_scale)
    return terms if return_terms else _loss_and_metrics(terms, inputs, params)
