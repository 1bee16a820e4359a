"""A GRPO loss call from its checks to its operators: the route every loss takes.

`functional.py`'s public losses check their inputs here (`linear_call`, `logits_call`: shapes
and dtypes, traceable) and then take one of these:

    linear head, a scalar loss with a gradient at token level: the three-pass route
        (`three_pass_loss`; `ops/route.py` decides, `ops/three_pass.py` computes); the same
        call wanting no gradient on Triton: its forward alone (the forward-only route);
    token-level importance sampling on Triton: the token-terms op, whose forward kernel runs the
        GRPO epilogue and returns weight·ℓ per token (`kernels/epilogue.py`);
    sequence-level (GSPO) ratios and the options that need whole sequences or the batch (vespo,
        the off-policy mask, the entropy quantile; `grpo_options`), and the chunked PyTorch
        backend: the selective log-prob op, then `grpo_math.policy_loss` around it;
    then Σ weight·ℓ, the entropy bonus and the metrics in PyTorch (`loss_and_metrics`).

The losses, the modules, the Hugging Face helpers, grpo_train and the TRL trainer all reach
the kernels through here. A packed batch (`cu_seqlens`) takes the same routes: the kernels see
its N tokens, and `grpo_math` works on [N] with the segment sums of `token_layouts.py`.
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
from .params import GRPOParams
from .token_layouts import layout_of
from .validation import (
    LossInputs,
    check_finite_advantages,
    check_grad_filter,
    check_linear_loss_inputs,
    check_logit_transform,
    check_logits_loss_inputs,
)


def linear_inputs(hidden, weight, bias):
    """The tensors the linear-head kernels take: contiguous hidden [N, D], weight, bias."""
    return hidden.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous()


def as_btv(logits: torch.Tensor) -> torch.Tensor:
    """A [B, T, V] view (a copy only if the layout forbids one) with a unit-stride last dim."""
    if logits.dim() == 1:
        logits = logits.reshape(1, 1, -1)
    elif logits.dim() == 2:
        logits = logits.unsqueeze(0)
    elif logits.dim() > 3:
        logits = logits.reshape(-1, *logits.shape[-2:])
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def eager_inplace(inplace: bool) -> bool:
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
    vespo_phi: torch.Tensor | None = None  # vespo's φ, detached (per token with [B, T]
    # advantages, else per sequence); None for other loss types
    entropy_mask: torch.Tensor | None = None  # top_entropy_quantile < 1: kept tokens (0/1)


def takes_terms_op(backend: str, params: GRPOParams) -> bool:
    """Does the call take the token-terms op (the GRPO epilogue inside the forward kernel)?
    Not for options that need a whole sequence or the batch before any token's loss."""
    return backend == "triton" and not params.needs_whole_sequences


def terms_args(inputs: LossInputs, params: GRPOParams) -> tuple:
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
    logp, ent, _, token_loss, _, kl, ratio, *_ = outputs
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


def loss_and_metrics(terms: GRPOTerms, inputs: LossInputs, params: GRPOParams):
    return finish_loss(terms.policy_loss, terms.entropy, terms.ratio, terms.kl, inputs, params,
                       vespo_phi=terms.vespo_phi, entropy_mask=terms.entropy_mask)


def linear_call(hidden, weight, completion_ids, advantages, completion_mask, old_logps,
                  ref_logps, bias, num_items_in_batch, importance_sampling_ratio, cu_seqlens,
                  grad_filter, params: GRPOParams, sampling_logps=None, softcap=None,
                  logit_scale=None) -> tuple:
    """The route of every linear-head GRPO loss: these checks (shapes and dtypes; traceable),
    then the three-pass path (`ops/three_pass.py`) or `linear_terms`. Returns the checked call:
    (ids [N], inputs, grad_filter's eps, backend, head = contiguous (hidden [N, D], weight
    [V, D], bias [V] | None), transform = (softcap, logit_scale))."""
    transform = check_logit_transform(softcap, logit_scale, params.temperature)
    ids, inputs = check_linear_loss_inputs(hidden, weight, bias, completion_ids, params,
                                           completion_mask, advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False,  # the op checks values
                                           cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    eps = check_grad_filter(grad_filter, hidden.dtype)
    head = linear_inputs(hidden.reshape(-1, hidden.shape[-1]), weight, bias)  # [N, D]
    return ids.reshape(-1), inputs, eps, backend_for(hidden), head, transform


def linear_terms(call: tuple, params: GRPOParams, entropy_gather=None,
                 shard=None) -> GRPOTerms:
    """The token-terms op, or the selective log-prob op with grpo_math, on a checked call
    (shard: a vocabulary-parallel head's, whose log-probs come from `parallel`)."""
    ids, inputs, eps, backend, head, transform = call
    if shard is not None:
        logp, ent = parallel.linear_logprobs(shard, *head, ids, params.temperature, eps,
                                             backend, *transform)
        return _unfused_terms(logp, ent, inputs, params, entropy_gather)
    if takes_terms_op(backend, params):
        outputs = OPS.linear_grpo_terms(*head, ids, params.temperature, eps, backend,
                                        *terms_args(inputs, params), *transform)
        return _terms_from_op(outputs, inputs, params)
    logp, ent, *_ = OPS.linear_logprobs(*head, ids, params.temperature, eps, backend,
                                       "completion_ids", *transform)
    return _unfused_terms(logp, ent, inputs, params, entropy_gather)


def three_pass_loss(call: tuple, params: GRPOParams, shard=None) -> tuple:
    """(loss, metrics, detached GRPOTerms) of a checked call on the three-pass route, or on the
    forward-only route when no gradient is wanted (shard: a vocabulary-parallel head's,
    computed by `parallel.linear_grpo_loss`). Per-token values at the rows not computed (masked
    tokens of a compacted batch): 0, and 1 for the ratio."""
    ids, inputs, _, backend, head, (_, logit_scale) = call
    g_ent = None
    if params.entropy_coef != 0.0:  # the bonus's d(loss)/d entropy per token
        g_ent = entropy_bonus_weights(inputs.mask, params.entropy_coef).reshape(-1)
    # a packed CUDA batch is not compacted: counting its masked tokens would read the device
    compact = inputs.cu_seqlens is None or head[0].device.type != "cuda"
    loss_grad = three_pass_op.linear_grpo_loss
    if shard is not None:
        loss_grad = functools.partial(parallel.linear_grpo_loss, shard)
    out = loss_grad(head, ids, terms_args(inputs, params), g_ent, backend, params.temperature,
                    logit_scale, compact)
    shape = inputs.mask.shape  # [B, T], or [N] packed
    ent, ratio = out.entropy.reshape(shape), out.ratio.reshape(shape)
    kl = None if params.beta == 0.0 else out.kl.reshape(shape)
    metrics = grpo_metrics(ent, ratio, kl, inputs.advantages, inputs.mask, params,
                           layout_of(inputs.mask, inputs.cu_seqlens), old_logps=inputs.old_logps)
    return out.loss, metrics, GRPOTerms(out.policy, out.logp.reshape(shape), ent, ratio, kl)


def linear_loss(call: tuple, params: GRPOParams, entropy_gather=None, *,
                return_terms: bool = False, return_token_values: bool = False, shard=None):
    """What `fused_linear_grpo_loss` returns for a checked call (`linear_call`): the
    three-pass route where `route.linear_loss_route` says so, the forward-only route (the
    three-pass call wanting no gradient) where it says that, else the four-pass one. shard: a
    vocabulary-parallel head's `parallel.VocabShard` (`vocab_parallel_call`), or None."""
    _exclusive(return_terms, return_token_values)
    _, inputs, eps, backend, head, (softcap, scale) = call
    path = route.linear_loss_route(*head, backend, params, softcap, eps,
                                   per_token_outputs=return_terms, vocab_parallel=shard,
                                   logit_scale=scale).path
    if path != route.FOUR_PASS:  # three-pass, or its first half alone (forward-only)
        loss, metrics, terms = three_pass_loss(call, params, shard)
        return (loss, metrics, terms) if return_token_values else (loss, metrics)
    return finish(linear_terms(call, params, entropy_gather, shard), inputs, params,
                  return_terms=return_terms, return_token_values=return_token_values)


def vocab_parallel_call(check, hidden, weight, bias, vocab_group, options: tuple = ()) -> tuple:
    """(None, check(hidden, weight, bias)) for a whole head; for a vocabulary-parallel one
    (a DTensor weight or vocab_group=, `parallel`), (its VocabShard, the checked call on the
    local tensors) once every rank of the group agrees on its inputs and options (the call's
    other arguments: params, the outputs asked for) (else the same error on every rank)."""
    if not parallel.is_vocab_parallel(weight, vocab_group):
        return None, check(hidden, weight, bias)
    shard, weight, bias, hidden = parallel.local_head(weight, bias, vocab_group, hidden)

    def inputs_of(call):
        ids, inputs, *_ = call
        per_token = {k: getattr(inputs, k) for k in (
            "mask", "advantages", "old_logps", "ref_logps", "importance_sampling_ratio",
            "num_items_in_batch", "cu_seqlens", "sampling_logps")}
        eps, backend, transform = call[2], call[3], call[5]
        return parallel.CallInputs(*call[4], ids, per_token,
                                   (eps, backend, transform, *options))

    return parallel.agreed(shard, lambda: check(hidden, weight, bias), inputs_of,
                           "completion_ids")


def finish(terms: GRPOTerms, inputs: LossInputs, params: GRPOParams, *,
           return_terms: bool = False, return_token_values: bool = False):
    """The four-pass route's result: the terms themselves (return_terms), or (loss, metrics),
    with the terms detached beside them (return_token_values)."""
    _exclusive(return_terms, return_token_values)
    if return_terms:
        return terms
    loss, metrics = loss_and_metrics(terms, inputs, params)
    if not return_token_values:
        return loss, metrics
    return loss, metrics, GRPOTerms(*(None if x is None else x.detach() for x in terms))


def _exclusive(return_terms: bool, return_token_values: bool) -> None:
    if return_terms and return_token_values:
        raise ValueError("return_terms (differentiable per-token terms) and return_token_values "
                         "(detached ones beside the loss) exclude each other; ask for one")


def logits_call(logits, completion_ids, advantages, completion_mask, old_logps, ref_logps,
                  num_items_in_batch, importance_sampling_ratio, cu_seqlens, inplace,
                  params: GRPOParams, sampling_logps=None, entropy_gather=None,
                  softcap=None, logit_scale=None) -> tuple[GRPOTerms, LossInputs]:
    """The route of every logits-input GRPO loss (see `linear_call`)."""
    transform = check_logit_transform(softcap, logit_scale, params.temperature)
    ids, inputs = check_logits_loss_inputs(logits, completion_ids, params, completion_mask,
                                           advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False,  # the op checks values
                                           cu_seqlens=cu_seqlens, sampling_logps=sampling_logps)
    x = as_btv(logits)  # [N, V] -> [1, N, V]
    backend = backend_for(x)
    if takes_terms_op(backend, params):
        outputs = OPS.logits_grpo_terms(x, ids.reshape(-1), params.temperature, backend,
                                        eager_inplace(inplace), *terms_args(inputs, params),
                                        *transform)
        return _terms_from_op(outputs, inputs, params), inputs
    logp, ent, *_ = OPS.logits_logprobs(x, ids.reshape(-1), params.temperature, backend,
                                        "completion_ids", eager_inplace(inplace), *transform)
    return _unfused_terms(logp, ent, inputs, params, entropy_gather), inputs
