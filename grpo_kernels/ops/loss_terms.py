"""The GRPO loss inside a loss op: its argument layout, the fused epilogue's inputs, and the eager
computation of (loss, metrics, per-token statistics, per-token coefficients).

A loss op (`custom_ops.py`) takes, after its kernel tensors and options, the GRPO inputs of
`LossInputs` and then the hyperparameters of `GRPOParams` (both in their field order): the layout
is written once here (`pack_loss_args` / `unpack_loss_args`) and the schema derives from it.

A packed batch (`cu_seqlens`) runs the kernels on its N tokens as they are; the epilogue's [N]
inputs come in packed order from the layout (`packing.py`), which expands per-sequence values
(advantages, rollout ratios, the grpo/sapo weights) to their tokens.
"""

from __future__ import annotations

import torch

from ..grpo_math import entropy_bonus_weights, grpo_loss_from_logps, grpo_metrics, token_weights
from ..kernels.epilogue import loss_kind
from ..packing import layout_of
from ..params import GRPOParams, op_schema
from ..validation import LossInputs
from . import fallback

# The GRPO arguments of a loss op: LossInputs' fields, then GRPOParams' fields.
LOSS_ARGS_SCHEMA = ("Tensor mask, Tensor advantages, Tensor? old_logps, Tensor? ref_logps, "
                    "Tensor? importance_sampling_ratio, Tensor? num_items_in_batch, "
                    "Tensor? cu_seqlens, " + op_schema())


def pack_loss_args(inputs: LossInputs, params: GRPOParams) -> tuple:
    """The GRPO arguments of a loss op, in LOSS_ARGS_SCHEMA's order."""
    return (inputs.mask, inputs.advantages, inputs.old_logps, inputs.ref_logps,
            inputs.importance_sampling_ratio, inputs.num_items_in_batch, inputs.cu_seqlens,
            *params.to_op_args())


def unpack_loss_args(args) -> tuple[LossInputs, GRPOParams]:
    """Inverse of `pack_loss_args`."""
    mask, advantages, old, ref, isr, num_items, cu_seqlens, *hyper = args
    inputs = LossInputs(mask, advantages, old, ref, isr, num_items, cu_seqlens)
    return inputs, GRPOParams.from_op_args(hyper)


def epilogue_args(params: GRPOParams, inputs: LossInputs, weight: torch.Tensor,
                  layout=None) -> dict:
    """Flattened [N] float32 inputs, fresh [N] outputs and flags for the forward kernels'
    GRPO epilogue (`kernels/epilogue.py: grpo_token_outputs`). weight: token_weights [B, T]
    (packed: [N]); layout: the batch's (`packing.layout_of`)."""
    layout = layout or layout_of(inputs.mask, inputs.cu_seqlens)
    flat = layout.flat  # [B, T], [B, 1], [N] or [S, 1] -> contiguous [N] in the kernels' order
    adv = flat(inputs.advantages)
    N = adv.shape[0]
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


def grpo_loss_terms(op, targets, tensors, inputs: LossInputs, params: GRPOParams, fused: bool):
    """Eager GRPO loss on a selective log-prob op (`kernel_ops`): (loss 0-dim, metrics dict,
    lse [N], entropy [N], dloss/dlogp [N], dloss/dentropy [N] or None when entropy_coef == 0).

    fused (token level on Triton): the epilogue inside the forward kernel gives weight·ℓ and
    weight·dℓ/dlogp per token. Otherwise (a loss op called on the torch backend, or the fused
    kernel failed and fell back) `grpo_math` runs on [B, T] and torch.func.grad gives the
    coefficients (the operations autograd would record). That branch runs eagerly only: under
    AOTAutograd's tracing modes torch.func cannot see through the op's inputs, which is why
    the public functions route every unfused case around the loss ops."""
    fused = fused and params.importance_sampling_level == "token"
    if fused and op.failed(tensors[0]):
        op, fused = op.on_torch(), False  # the Triton kernels failed earlier (fallback.py)
    if fused:
        try:
            return _fused_terms(op, targets, tensors, inputs, params)
        except Exception as exc:
            # the epilogue runs only inside the Triton forward: a kernel that fails to compile
            # or launch re-runs unfused on the chunked PyTorch backend
            x = tensors[0]
            if not fallback.note_failure(exc, op.family, x.device, x.dtype,
                                         f"{op.family} forward with the GRPO epilogue"):
                raise
        op = op.on_torch()
    shape = inputs.mask.shape  # [B, T], or [N] packed
    logp, ent, lse = op.forward(targets, None, *tensors)

    def loss_of(logp, ent):
        return grpo_loss_from_logps(logp.reshape(shape), ent.reshape(shape), inputs, params)

    loss, metrics = loss_of(logp, ent)  # the values, outside the transform
    coef_logp, coef_ent = torch.func.grad(lambda lp, h: loss_of(lp, h)[0], (0, 1))(logp, ent)
    return loss, metrics, lse, ent, coef_logp, coef_ent if params.entropy_coef != 0.0 else None


def _fused_terms(op, targets, tensors, inputs: LossInputs, params: GRPOParams):
    layout = layout_of(inputs.mask, inputs.cu_seqlens)
    weights = token_weights(inputs.mask, params, inputs.num_items_in_batch, layout)
    epilogue = epilogue_args(params, inputs, weights, layout)
    _, ent, lse = op.forward(targets, epilogue, *tensors)
    lossw, coef_logp, kl, ratio = epilogue["tensors"][-4:]  # the outputs the kernel filled, [N]
    loss = lossw.sum()
    coef_ent = None
    if params.entropy_coef != 0.0:
        # the bonus is linear in the entropies: Σ coef_ent·entropy, coef_ent its gradient
        coef_ent = entropy_bonus_weights(inputs.mask.reshape(-1), params.entropy_coef)
        loss = loss + (coef_ent * ent).sum()
    shape = inputs.mask.shape  # [B, T], or [N] packed
    metrics = grpo_metrics(
        ent.reshape(shape), ratio.reshape(shape), kl.reshape(shape) if params.beta != 0.0 else None,
        inputs.advantages, inputs.mask, params, layout,
    )
    return loss, metrics, lse, ent, coef_logp, coef_ent
