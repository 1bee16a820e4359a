"""grpo-kernels: fused Triton GRPO losses with TRL semantics, without full-vocabulary logits."""

from .fused_linear_grpo import fused_linear_grpo_loss
from .modules import FusedLinearGRPOLoss
from .params import LOSS_TYPES, GRPOParams
from .selective_logprobs import force_backend, selective_logprobs

__all__ = [
    "FusedLinearGRPOLoss",
    "GRPOParams",
    "LOSS_TYPES",
    "force_backend",
    "fused_linear_grpo_loss",
    "selective_logprobs",
]
__version__ = "0.1.0"
