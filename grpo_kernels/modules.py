"""nn.Module wrappers: they hold the hyperparameters and call the functional API."""

from __future__ import annotations

import torch
from torch import nn

from .fused_linear_grpo import fused_linear_grpo_loss_with_params
from .params import GRPOParams
from .validation import check_grad_filter


class FusedLinearGRPOLoss(nn.Module):
    """GRPO loss from hidden states and the lm_head weight; see `fused_linear_grpo_loss`."""

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
        grad_filter: float | str | None = None,
    ):
        super().__init__()
        self.params = GRPOParams.pick(locals())
        check_grad_filter(grad_filter, torch.bfloat16)  # fail here, not at the first step
        self.grad_filter = grad_filter  # a kernel option, not a GRPO hyperparameter

    def extra_repr(self) -> str:
        extra = "" if self.grad_filter is None else f", grad_filter={self.grad_filter!r}"
        return ", ".join(f"{k}={v!r}" for k, v in vars(self.params).items()) + extra

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        completion_ids: torch.Tensor,
        advantages: torch.Tensor,
        completion_mask: torch.Tensor | None = None,
        old_logps: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        num_items_in_batch=None,
        importance_sampling_ratio: torch.Tensor | None = None,
    ):
        return fused_linear_grpo_loss_with_params(
            hidden, weight, completion_ids, advantages, completion_mask, old_logps, ref_logps,
            bias, self.params, num_items_in_batch, importance_sampling_ratio, self.grad_filter,
        )
