"""Logits-input GRPO loss, for training loops that already hold [B, T, V] logits.

Same semantics, validation and per-token epilogue as the fused linear loss; the kernels stream
each logits row once in forward and once (read + write) in backward. Nothing of [B, T, V] float32
is allocated: logits are read in their own dtype, and views sliced out of a model's output are
read in place.
"""

from __future__ import annotations

import torch
from torch import nn

from . import custom_ops
from .fused_linear_grpo import loss_and_metrics, loss_op_args, unfused_loss
from .params import GRPOParams
from .selective_logprobs import backend_for
from .validation import (
    check_logits,
    check_logits_loss_inputs,
    check_temperature,
    check_token_ids,
)


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
    logp, ent, _ = custom_ops.OPS.logits_logprobs(x, ids.reshape(-1), temperature,
                                                  backend_for(x), "targets", _eager(inplace))
    logp = logp.reshape(lead)
    return (logp, ent.reshape(lead)) if return_entropy else logp


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
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
    inplace: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss (GRPO_SPEC.md) from logits [B, T, V]; logits[b, t] predicts completion_ids[b, t].

    Arguments as `fused_linear_grpo_loss`; `inplace=True` writes d logits over the logits buffer
    in backward (the logits are garbage afterwards).

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
    return grpo_loss_with_params(logits, completion_ids, advantages, completion_mask, old_logps,
                                 ref_logps, params, num_items_in_batch,
                                 importance_sampling_ratio, inplace)


def grpo_loss_with_params(logits, completion_ids, advantages, completion_mask, old_logps,
                          ref_logps, params: GRPOParams, num_items_in_batch=None,
                          importance_sampling_ratio=None, inplace=False):
    """`grpo_loss` with a prebuilt GRPOParams (what `GRPOLoss` calls)."""
    ids, inputs = check_logits_loss_inputs(logits, completion_ids, params, completion_mask,
                                           advantages, old_logps, ref_logps,
                                           importance_sampling_ratio, num_items_in_batch,
                                           check_values=False)  # the op checks values
    x = _as_btv(logits)
    backend = backend_for(x)
    if backend == "triton" and params.importance_sampling_level == "token":
        outputs = custom_ops.OPS.logits_grpo_loss(x, ids.reshape(-1),
                                                  *loss_op_args(inputs, params), backend,
                                                  _eager(inplace))
        return loss_and_metrics(outputs, params)
    logp, ent, _ = custom_ops.OPS.logits_logprobs(x, ids.reshape(-1), params.temperature,
                                                  backend, "completion_ids", _eager(inplace))
    return unfused_loss(logp, ent, inputs, params)


class GRPOLoss(nn.Module):
    """GRPO loss from logits; holds the hyperparameters of `grpo_loss`."""

    def __init__(
        self,
        beta: float = 0.0,
        epsilon_low: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        temperature: float = 1.0,
        loss_type: str = "dapo",
        importance_sampling_level: str = "token",
        max_completion_length: int | None = None,
        use_bias_correction_kl: bool = False,
        entropy_coef: float = 0.0,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        inplace: bool = False,
    ):
        super().__init__()
        self.params = GRPOParams.pick(locals())
        self.inplace = inplace

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in vars(self.params).items())

    def forward(self, logits, completion_ids, advantages, completion_mask=None, old_logps=None,
                ref_logps=None, num_items_in_batch=None, importance_sampling_ratio=None):
        return grpo_loss_with_params(logits, completion_ids, advantages, completion_mask,
                                     old_logps, ref_logps, self.params, num_items_in_batch,
                                     importance_sampling_ratio, self.inplace)
