"""Fused linear GRPO loss: hidden states + lm_head weight -> GRPO loss, without [N, V] logits.

Token-level importance sampling on the Triton backend runs the GRPO epilogue inside the forward
kernel (per-token loss and dℓ/dlogp in one pass), as the custom operator
grpo_kernels::linear_grpo_loss (custom_ops.py); backward is one recompute-and-accumulate kernel
driven by that saved coefficient. Sequence-level (GSPO) ratios need every token of a sequence
first, so that case, and the chunked PyTorch backend, use the differentiable selective log-prob
op plus `grpo_math` on [B, T].
"""

from __future__ import annotations

import torch

from . import custom_ops
from .epilogue import loss_kind
from .grpo_math import grpo_loss_from_logps
from .params import GRPOParams
from .selective_logprobs import backend_for, linear_inputs, linear_logprobs_2d
from .validation import (
    LossInputs,
    check_finite_advantages,
    check_grad_filter,
    check_linear_loss_inputs,
)


def epilogue_args(params: GRPOParams, inputs: LossInputs, weight: torch.Tensor) -> dict:
    """Flattened [N] float32 inputs, fresh [N] outputs and flags for `grpo_token_outputs`."""
    B, T = inputs.mask.shape
    N = B * T

    def flat(x):  # [B, T] or [B, 1] -> contiguous [N]
        return torch.broadcast_to(x, (B, T)).reshape(N).contiguous()

    adv = flat(inputs.advantages)
    outs = [torch.empty(N, device=adv.device, dtype=torch.float32) for _ in range(4)]
    tensors = [
        adv if inputs.old_logps is None else flat(inputs.old_logps),
        adv if inputs.ref_logps is None else flat(inputs.ref_logps),
        adv,
        adv if inputs.importance_sampling_ratio is None else flat(inputs.importance_sampling_ratio),
        flat(weight),
        *outs,  # weight·ℓ, weight·dℓ/dlogp, kl, ratio
    ]
    return dict(
        tensors=tensors,
        scalars=[params.epsilon_low, params.eps_high,
                 params.delta if params.delta is not None else 0.0, params.beta,
                 params.sapo_temperature_pos, params.sapo_temperature_neg],
        LOSS_KIND=loss_kind(params.loss_type),
        HAS_OLD=inputs.old_logps is not None,
        HAS_DELTA=params.delta is not None,
        HAS_KL=params.beta != 0.0,
        BIAS_CORRECT_KL=params.use_bias_correction_kl,
        HAS_ISR=inputs.importance_sampling_ratio is not None,
    )


def loss_op_args(inputs: LossInputs, params: GRPOParams) -> tuple:
    """The GRPO inputs and hyperparameters of a loss op, in its schema's order (custom_ops)."""
    n = inputs.num_items_in_batch
    tensor_n = n if isinstance(n, torch.Tensor) else None
    value_n = None if n is None or tensor_n is not None else float(n)
    return (inputs.mask, inputs.advantages, inputs.old_logps, inputs.ref_logps,
            inputs.importance_sampling_ratio, tensor_n, value_n, *custom_ops.hyper_args(params))


def loss_and_metrics(outputs, params: GRPOParams):
    """(loss, metrics dict) from a loss op's outputs (metrics: one float32 tensor [K])."""
    loss, metrics = outputs[0], outputs[1]
    return loss, dict(zip(custom_ops.metric_names(params), metrics.unbind(0)))


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
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    temperature: float = 1.0,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    entropy_coef: float = 0.0,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    grad_filter: float | str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss (GRPO_SPEC.md, TRL semantics) straight from hidden states and the lm_head weight.

    Args:
        hidden: [B, T, D] hidden states; hidden[b, t] predicts completion_ids[b, t].
        weight: [V, D] lm_head weight (same dtype/device as hidden); bias: optional [V].
        completion_ids: [B, T] token ids in [0, V).
        advantages: [B], [B, 1] or [B, T], finite.
        completion_mask: [B, T], 1 for real completion tokens (default: all ones).
        old_logps: [B, T] log-probs under the sampling policy (default: logp.detach()).
        ref_logps: [B, T] log-probs under the reference policy; required when beta != 0.
        importance_sampling_ratio: [B], [B, 1] or [B, T] rollout-engine correction.
        grad_filter: None (exact, default), "auto" or eps >= 0: gradient filtering in the
            Triton backward (approximate; see `selective_logprobs`).
        The remaining keywords are GRPOParams' (TRL names and defaults).

    Returns:
        (loss: 0-dim float32, metrics: dict of detached 0-dim float32 tensors)
    """
    params = GRPOParams(  # spelled out: torch.compile of torch 2.4-2.8 cannot trace locals()
        beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        temperature=temperature, loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length, use_bias_correction_kl=use_bias_correction_kl,
        entropy_coef=entropy_coef, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg)
    return fused_linear_grpo_loss_with_params(
        hidden, weight, completion_ids, advantages, completion_mask, old_logps, ref_logps, bias,
        params, num_items_in_batch, importance_sampling_ratio, grad_filter,
    )


def fused_linear_grpo_loss_with_params(
    hidden, weight, completion_ids, advantages, completion_mask, old_logps, ref_logps, bias,
    params: GRPOParams, num_items_in_batch=None, importance_sampling_ratio=None,
    grad_filter=None,
):
    """`fused_linear_grpo_loss` with a prebuilt GRPOParams (what the nn.Module calls)."""
    ids, inputs = check_linear_loss_inputs(hidden, weight, bias, completion_ids, params,
                                           completion_mask, advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False)  # the op checks values
    B, T, D = hidden.shape
    eps = check_grad_filter(grad_filter, hidden.dtype)
    backend = backend_for(hidden)
    if backend == "triton" and params.importance_sampling_level == "token":
        outputs = custom_ops.OPS.linear_grpo_loss(
            *linear_inputs(hidden.reshape(B * T, D), weight, bias), ids.reshape(-1),
            *loss_op_args(inputs, params), eps, backend)
        return loss_and_metrics(outputs, params)
    logp, ent = linear_logprobs_2d(hidden.reshape(B * T, D), weight, bias, ids.reshape(-1),
                                   params.temperature, backend, eps, "completion_ids")
    return unfused_loss(logp, ent, inputs, params)


def unfused_loss(logp, ent, inputs: LossInputs, params: GRPOParams):
    """Sequence-level ratios, or the chunked PyTorch backend: the differentiable log-probs of the
    selective op (which checks the token ids) go through `grpo_math` on [B, T] (traceable)."""
    check_finite_advantages(inputs.advantages)  # in-graph under torch.compile
    B, T = inputs.mask.shape
    return grpo_loss_from_logps(
        logp.reshape(B, T), ent.reshape(B, T), inputs.mask, inputs.advantages,
        inputs.old_logps, inputs.ref_logps, params, inputs.num_items_in_batch,
        inputs.importance_sampling_ratio)
