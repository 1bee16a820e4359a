"""grpo-kernels: fused Triton GRPO losses with TRL semantics, without full-vocabulary logits."""

from . import torch_check  # noqa: F401  (first: an unsupported torch fails here, in one line)
from .fused_linear_grpo import fused_linear_grpo_loss
from .logits_grpo import GRPOLoss, grpo_loss, logprobs_from_logits
from .modules import FusedLinearGRPOLoss
from .params import LOSS_TYPES, GRPOParams
from .selective_logprobs import force_backend, selective_logprobs

__all__ = [
    "FusedLinearGRPOLoss",
    "GRPOLoss",
    "GRPOParams",
    "LOSS_TYPES",
    "force_backend",
    "fused_linear_grpo_loss",
    "grpo_loss",
    "logprobs_from_logits",
    "selective_logprobs",
]
__version__ = "0.1.0"
