"""GRPO hyperparameters: one frozen dataclass shared by every implementation.

The kernels, the chunked PyTorch path and the reference all read their hyperparameters from
`GRPOParams`, so an option is validated once and means the same thing everywhere. Names and
defaults are TRL's (see GRPO_SPEC.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
# Loss types whose per-token loss is the PPO-style clipped surrogate.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _check_finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class GRPOParams:
    """Hyperparameters of the GRPO loss (TRL names and defaults)."""

    beta: float = 0.0  # weight of the k3 KL penalty; 0 disables it (no ref_logps needed)
    epsilon_low: float = 0.2  # lower clip: ratio >= 1 - epsilon_low
    epsilon_high: float | None = None  # upper clip (None -> epsilon_low); cispo: the raw cap
    delta: float | None = None  # two-sided clipping: ratio capped at delta in the unclipped term
    temperature: float = 1.0  # policy logits are divided by this before the softmax
    loss_type: str = "dapo"  # one of LOSS_TYPES
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO)
    max_completion_length: int | None = None  # dr_grpo's fixed normalizer
    use_bias_correction_kl: bool = False  # multiply the k3 KL by the importance ratio
    entropy_coef: float = 0.0  # loss -= entropy_coef * mean entropy (needs entropy grads)
    sapo_temperature_pos: float = 1.0  # SAPO soft-gate temperature for A > 0
    sapo_temperature_neg: float = 1.05  # SAPO soft-gate temperature for A <= 0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                "importance_sampling_level must be one of "
                f"{IMPORTANCE_SAMPLING_LEVELS}, got {self.importance_sampling_level!r}"
            )
        for name in ("beta", "epsilon_low", "temperature", "entropy_coef",
                     "sapo_temperature_pos", "sapo_temperature_neg"):
            _check_finite(name, getattr(self, name))
        if self.epsilon_high is not None:
            _check_finite("epsilon_high", self.epsilon_high)
        if self.epsilon_low < 0 or self.eps_high < 0:
            raise ValueError(
                "epsilon_low and epsilon_high must be >= 0, "
                f"got {self.epsilon_low}, {self.eps_high}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.delta is not None:
            _check_finite("delta", self.delta)
            if self.delta <= 0:
                raise ValueError(f"delta must be > 0 (a cap on the ratio), got {self.delta}")
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            raise ValueError("sapo_temperature_pos and sapo_temperature_neg must be > 0")
        if self.loss_type == "dr_grpo":
            if self.max_completion_length is None:
                raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normalizer)")
        if self.max_completion_length is not None:
            m = self.max_completion_length
            if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
                raise ValueError(f"max_completion_length must be a positive int, got {m!r}")

    @classmethod
    def pick(cls, namespace: dict) -> GRPOParams:
        """Build from the hyperparameters found in `namespace` (e.g. a function's locals())."""
        # a constant tuple of names, not dataclasses.fields(): torch.compile traces this
        return cls(**{name: namespace[name] for name in FIELD_NAMES if name in namespace})

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def is_clipped(self) -> bool:
        return self.loss_type in CLIPPED_LOSS_TYPES


FIELD_NAMES = tuple(f.name for f in fields(GRPOParams))
