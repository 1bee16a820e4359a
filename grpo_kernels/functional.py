"""The functional API: selective log-probs and GRPO losses, from hidden states or from logits.

    selective_logprobs(hidden, weight, targets)          log p(target) of a linear head
    logprobs_from_logits(logits, targets)                log p(target) from logits
    fused_linear_grpo_loss(hidden, weight, ids, adv)     GRPO loss of a linear head
    grpo_loss(logits, ids, adv)                          GRPO loss from logits

None of them materializes full-vocabulary float32 logits. Each checks shapes and dtypes here
(traceable by torch.compile) and calls a custom operator (`ops/custom_ops.py`) on the backend of
`ops/backends.py`. Token-level importance sampling on Triton runs the GRPO epilogue inside the
forward kernel (the loss ops); sequence-level (GSPO) ratios need every token of a sequence first,
so that case and the chunked PyTorch backend take the differentiable selective log-prob op and
run `grpo_math` on [B, T] around it. The semantics are in docs/semantics.md.

A packed batch (`cu_seqlens`, hidden [N, D] or logits [N, V]) takes the same routes: the kernels
see its N tokens, and `grpo_math` works on [N] with the segment sums of `packing.py`.
"""

from __future__ import annotations

import torch

from .grpo_math import grpo_loss_from_logps, metric_names
from .ops.backends import backend_for
from .ops.custom_ops import OPS
from .ops.loss_terms import pack_loss_args
from .params import GRPOParams, signature_with_params
from .validation import (
    LossInputs,
    check_finite_advantages,
    check_grad_filter,
    check_linear_head,
    check_linear_loss_inputs,
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


def _loss_and_metrics(outputs, params: GRPOParams):
    """(loss, metrics dict) from a loss op's outputs (metrics: one float32 tensor [K])."""
    loss, metrics = outputs[0], outputs[1]
    return loss, dict(zip(metric_names(params), metrics.unbind(0)))


def _unfused_loss(logp, ent, inputs: LossInputs, params: GRPOParams):
    """Sequence-level ratios, or the chunked PyTorch backend: the differentiable log-probs [N]
    of the selective op (which checks the token ids) go through `grpo_math` on [B, T] (or [N]
    packed) (traceable)."""
    check_finite_advantages(inputs.advantages)  # in-graph under torch.compile
    shape = inputs.mask.shape  # [B, T], or [N] packed
    return grpo_loss_from_logps(logp.reshape(shape), ent.reshape(shape), inputs, params)


# ---- selective log-probs ----------------------------------------------------------------------


def selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    grad_filter: float | str | None = None,
):
    """Log-probability of `targets` under softmax((hidden @ weight.T + bias) / temperature).

    Never materializes the [..., V] logits. Differentiable w.r.t. hidden, weight and bias, through
    both outputs. Under torch.no_grad() it is the cheap scoring path for old/reference policies.

    Args:
        hidden: [..., D] float16/bfloat16/float32 hidden states.
        weight: [V, D] output-embedding (lm_head) weight, same dtype and device as hidden.
        targets: [...] integer token ids in [0, V).
        bias: optional [V] lm_head bias.
        temperature: logits are divided by it before the softmax.
        return_entropy: also return the entropy of the full distribution (nats).
        grad_filter: None (default) for the exact backward. "auto" or an eps >= 0 turns on
            gradient filtering in the Triton backward: a [tokens × vocabulary] tile whose
            d logits are all <= eps × its token's gradient scale is skipped (approximate;
            "auto" = finfo(dtype).eps / 32, 2^-12 for bfloat16). Other backends stay exact.

    Returns:
        logp [...] float32, and entropy [...] float32 if return_entropy.
    """
    check_linear_head(hidden, weight, bias)
    temperature = check_temperature(temperature)
    lead = hidden.shape[:-1]
    ids = check_token_ids("targets", targets, weight.shape[0], lead, hidden.device,
                          check_values=False)  # the op checks the range (torch.compile)
    eps = check_grad_filter(grad_filter, hidden.dtype)
    logp, ent, _ = OPS.linear_logprobs(
        *_linear_inputs(hidden.reshape(-1, hidden.shape[-1]), weight, bias), ids.reshape(-1),
        temperature, eps, backend_for(hidden), "targets")
    logp = logp.reshape(lead)
    return (logp, ent.reshape(lead)) if return_entropy else logp


def logprobs_from_logits(logits, targets, *, temperature=1.0, return_entropy=False,
                         inplace=False):
    """Log-probability of `targets` under softmax(logits / temperature), without a float32
    [..., V] log-softmax.

    Args:
        logits: [..., V] float16/bfloat16/float32 (read in its own dtype).
        targets: [...] integer ids in [0, V).
        temperature: logits are divided by it first.
        return_entropy: also return the entropy (nats) of each distribution.
        inplace: backward writes d logits over `logits` (saves one [..., V] buffer; `logits`
            holds its gradient afterwards and must not be used again).

    Returns:
        logp [...] float32 (and entropy [...] float32); differentiable w.r.t. logits.
    """
    check_logits(logits)
    temperature = check_temperature(temperature)
    lead = logits.shape[:-1]
    ids = check_token_ids("targets", targets, logits.shape[-1], lead, logits.device,
                          "logits.shape[-1]", check_values=False)  # the op checks the range
    x = _as_btv(logits)
    logp, ent, _ = OPS.logits_logprobs(x, ids.reshape(-1), temperature, backend_for(x),
                                       "targets", _eager(inplace))
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
    params: GRPOParams | None = None,
    **hyperparameters,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
        num_items_in_batch: dapo/cispo's normalizer (default: the mask's token count).
        importance_sampling_ratio: [B], [B, 1] or [B, T] rollout-engine correction.
        cu_seqlens: a packed batch of S sequences (docs/semantics.md, "Packed batches"):
            int32/int64 [S + 1], sequence s holds tokens cu_seqlens[s]:cu_seqlens[s+1]. Then
            hidden is [N, D], completion_ids, old/ref log-probs (and mask, optional) are [N],
            advantages and importance_sampling_ratio [S], [S, 1] or [N]. Equals the padded call.
        grad_filter: None (exact, default), "auto" or eps >= 0: gradient filtering in the
            Triton backward (approximate; see `selective_logprobs`).
        params: a GRPOParams, or the hyperparameters as keywords (GRPOParams' fields: beta,
            epsilon_low, epsilon_high, delta, temperature, loss_type, ...), not both.

    Returns:
        (loss: 0-dim float32, metrics: dict of detached 0-dim float32 tensors)
    """
    params = GRPOParams.resolve(params, hyperparameters)
    ids, inputs = check_linear_loss_inputs(hidden, weight, bias, completion_ids, params,
                                           completion_mask, advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False,  # the op checks values
                                           cu_seqlens=cu_seqlens)
    eps = check_grad_filter(grad_filter, hidden.dtype)
    backend = backend_for(hidden)
    head = _linear_inputs(hidden.reshape(-1, hidden.shape[-1]), weight, bias)  # [N, D]
    if backend == "triton" and params.importance_sampling_level == "token":
        outputs = OPS.linear_grpo_loss(*head, ids.reshape(-1), eps, backend,
                                       *pack_loss_args(inputs, params))
        return _loss_and_metrics(outputs, params)
    logp, ent, _ = OPS.linear_logprobs(*head, ids.reshape(-1), params.temperature, eps, backend,
                                       "completion_ids")
    return _unfused_loss(logp, ent, inputs, params)


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
    params: GRPOParams | None = None,
    **hyperparameters,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss (docs/semantics.md) from logits [B, T, V]; logits[b, t] predicts
    completion_ids[b, t]. Nothing of [B, T, V] float32 is allocated: logits are read in their
    own dtype, and views sliced out of a model's output are read in place.

    Arguments as `fused_linear_grpo_loss` (a packed batch: logits [N, V] with `cu_seqlens`);
    `inplace=True` writes d logits over the logits buffer in backward (the logits are garbage
    afterwards).

    Returns:
        (loss: 0-dim float32, metrics: dict of detached 0-dim float32 tensors)
    """
    params = GRPOParams.resolve(params, hyperparameters)
    ids, inputs = check_logits_loss_inputs(logits, completion_ids, params, completion_mask,
                                           advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False,  # the op checks values
                                           cu_seqlens=cu_seqlens)
    x = _as_btv(logits)  # [N, V] -> [1, N, V]
    backend = backend_for(x)
    if backend == "triton" and params.importance_sampling_level == "token":
        outputs = OPS.logits_grpo_loss(x, ids.reshape(-1), backend, _eager(inplace),
                                       *pack_loss_args(inputs, params))
        return _loss_and_metrics(outputs, params)
    logp, ent, _ = OPS.logits_logprobs(x, ids.reshape(-1), params.temperature, backend,
                                       "completion_ids", _eager(inplace))
    return _unfused_loss(logp, ent, inputs, params)
