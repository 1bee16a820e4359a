"""Fused linear GRPO loss: hidden states + lm_head weight -> GRPO loss, without [N, V] logits.

Token-level importance sampling on the Triton backend runs the GRPO epilogue inside the forward
kernel (per-token loss and dℓ/dlogp in one pass); backward is one recompute-and-accumulate kernel
driven by that saved coefficient. Sequence-level (GSPO) ratios need every token of a sequence
first, so that case, and the chunked PyTorch backend, use the differentiable selective log-prob
plus `grpo_math` on [B, T].
"""

from __future__ import annotations

import torch

from . import fallback
from .autograd import LinearHeadOp, SelectiveLogprob
from .epilogue import loss_kind
from .grpo_math import grpo_loss_from_logps, grpo_metrics, token_weights
from .params import GRPOParams
from .selective_logprobs import IMPLS, backend_for, linear_inputs
from .validation import LossInputs, check_grad_filter, check_linear_loss_inputs


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


def grpo_loss_on_op(op, targets, tensors, inputs: LossInputs, params: GRPOParams, fused: bool):
    """The GRPO loss on top of a selective log-prob op (linear head or logits).

    fused: token-level ratios on the Triton backend, where the epilogue runs inside the forward
    kernel; otherwise the differentiable log-probs go through `grpo_math` on [B, T].
    """
    B, T = inputs.mask.shape
    if fused and op.failed(tensors[0]):
        op, fused = op.on_torch(), False  # the Triton kernels failed earlier (fallback.py)
    if fused:
        try:
            return _fused_loss(op, targets, tensors, inputs, params)
        except Exception as exc:
            # the epilogue runs only inside the Triton forward: a kernel that fails to compile
            # or launch re-runs unfused on the chunked PyTorch backend (fallback.py)
            x = tensors[0]
            if not fallback.note_failure(exc, op.family, x.device, x.dtype,
                                         f"{op.family} forward with the GRPO epilogue"):
                raise
        op = op.on_torch()
    logp, ent, _ = SelectiveLogprob.apply(op, targets, None, *tensors)
    return grpo_loss_from_logps(
        logp.reshape(B, T), ent.reshape(B, T), inputs.mask, inputs.advantages,
        inputs.old_logps, inputs.ref_logps, params, inputs.num_items_in_batch,
        inputs.importance_sampling_ratio,
    )


def _fused_loss(op, targets, tensors, inputs: LossInputs, params: GRPOParams):
    """Token-level loss with the epilogue inside the Triton forward kernel."""
    B, T = inputs.mask.shape
    weights, ent_norm = token_weights(inputs.mask, params, inputs.num_items_in_batch)
    epilogue = epilogue_args(params, inputs, weights)
    _, ent, loss = SelectiveLogprob.apply(op, targets, epilogue, *tensors)
    kl, ratio = epilogue["tensors"][7:9]  # filled by the kernel, [N]
    ent = ent.reshape(B, T)
    if params.entropy_coef != 0.0:
        loss = loss - params.entropy_coef * (ent * inputs.mask).sum() / ent_norm
    metrics = grpo_metrics(
        ent.detach(), ratio.reshape(B, T), kl.reshape(B, T) if params.beta != 0.0 else None,
        inputs.advantages, inputs.mask, params,
    )
    return loss, metrics


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
    params = GRPOParams.pick(locals())
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
                                           importance_sampling_ratio, num_items_in_batch)
    B, T, D = hidden.shape
    backend = backend_for(hidden)
    fused = backend == "triton" and params.importance_sampling_level == "token"
    op = LinearHeadOp(IMPLS[backend], params.temperature,
                      check_grad_filter(grad_filter, hidden.dtype))
    tensors = linear_inputs(hidden.reshape(B * T, D), weight, bias)
    return grpo_loss_on_op(op, ids.reshape(-1), tensors, inputs, params, fused)
