"""TRL integration: `GRPOTrainer`, TRL's trainer with grpo-kernels' fused, logits-free loss.

    from grpo_kernels.trl import GRPOTrainer      # instead of: from trl import GRPOTrainer

See `trainer.py` for what changes and what falls back to TRL's own code.
"""

from ..hf import fsdp2_root, run_as_forward  # re-exported: the FSDP2 helper lives in hf/fsdp.py
from .losses import policy_terms
from .trainer import GRPOTrainer

__all__ = ["GRPOTrainer", "fsdp2_root", "policy_terms", "run_as_forward"]
