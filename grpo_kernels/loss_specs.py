"""Loss types: one registry entry each, read by every decision that depends on the type.

A loss type is an objective (how each token's loss ℓ is formed) and a normalizer (how the token
losses are summed into the loss). Both are typed values of this module, compared by identity,
never by name:

`Objective`, one per formula, with what every caller needs to know of it:
    name           the formula's name (docs/semantics.md; compile_check's variant names)
    kernel_code    the Triton epilogue's LOSS_KIND (`kernels/epilogue.py` branches on it), or
                   None where ℓ needs a whole sequence (the per-sequence route of grpo_math)
    clip_flags     the names of its clip metrics, in the order its formula returns them
    sequence_weight  its loss weighs each sequence by a detached φ computed from the sequence
                   (vespo): φ is logged (`SEQUENCE_WEIGHT_METRIC`) and takes the rollout ratio
    one_loss_per_sequence  ℓ is one value per sequence (gmpo): no per-token selection
    rollout_ratio_inside   the rollout importance ratio enters inside its own weight instead of
                   multiplying ℓ (vespo, gmpo)
Its formulas live in `grpo_math` (`OBJECTIVE_MATH`: ℓ and the clip flags, keyed by the
Objective) and, for a per-token objective, in the epilogue (its LOSS_KIND branch).

`Normalizer` (`grpo_math.token_weights` computes each):
    SEQUENCE_MEAN   mean over sequences of each sequence's token mean
    BATCH_TOKENS    over the micro-batch's completion tokens
    FIXED_LENGTH    over sequences × max_completion_length (needs it)
    TOKEN_COUNT     over the step's completion tokens (num_items_in_batch)
    SEQUENCE_SUM    mean over sequences of each sequence's token sum

`LossSpec`: a loss type's name, objective, normalizer, the importance-sampling levels it is
defined at and whether TRL 1.16's GRPOTrainer has it (the TRL subclass refuses the rest).

Adding a per-token loss type: docs/internals.md, "Adding a loss type". An unknown name is an
error wherever it is looked up (`spec_of`); nothing falls through to a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Normalizer(Enum):
    SEQUENCE_MEAN = "sequence_mean"
    BATCH_TOKENS = "batch_tokens"
    FIXED_LENGTH = "fixed_length"
    TOKEN_COUNT = "token_count"
    SEQUENCE_SUM = "sequence_sum"

    @property
    def needs_max_completion_length(self) -> bool:
        return self is Normalizer.FIXED_LENGTH


CLIP_FLAGS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CISPO_FLAG = "cispo_clip_ratio"
SEQUENCE_WEIGHT_METRIC = "vespo/phi_seq_mean"  # TRL 1.16's key for vespo's φ


@dataclass(frozen=True, eq=False)  # compared by identity: one object per formula
class Objective:
    name: str
    kernel_code: int | None
    clip_flags: tuple[str, ...] = CLIP_FLAGS
    sequence_weight: bool = False
    one_loss_per_sequence: bool = False
    rollout_ratio_inside: bool = False

    @property
    def per_sequence(self) -> bool:
        """Whether ℓ needs every token of its sequence first (no per-token epilogue)."""
        return self.kernel_code is None

    def __repr__(self) -> str:
        return f"Objective({self.name!r})"


# The per-token objectives' LOSS_KIND codes are their index here (kernels/epilogue.py).
CLIPPED = Objective("clipped", 0)  # PPO's clipped surrogate (+ the delta cap)
CISPO = Objective("cispo", 1, clip_flags=(CISPO_FLAG,))
SAPO = Objective("sapo", 2, clip_flags=())
# binary total-variation trust-region mask (DPPO-Binary-TV; prime-rl's default objective)
DPPO = Objective("dppo", 3)
VESPO = Objective("vespo", None, clip_flags=(), sequence_weight=True, rollout_ratio_inside=True)
# geometric mean of the clipped token ratios per sequence (GMPO; verl's "geo_mean")
GMPO = Objective("gmpo", None, one_loss_per_sequence=True, rollout_ratio_inside=True)
OBJECTIVES = (CLIPPED, CISPO, SAPO, DPPO, VESPO, GMPO)


@dataclass(frozen=True)
class LossSpec:
    name: str
    objective: Objective
    normalizer: Normalizer
    levels: tuple[str, ...] = ("token", "sequence")
    in_trl: bool = True

    @property
    def kernel_code(self) -> int | None:
        return self.objective.kernel_code

    @property
    def clip_flags(self) -> tuple[str, ...]:
        return self.objective.clip_flags

    @property
    def clips(self) -> bool:
        """Whether its objective keeps the ratio in a trust region (clip flags are logged)."""
        return bool(self.clip_flags)

    @property
    def per_sequence(self) -> bool:
        """Whether ℓ needs every token of its sequence first (no per-token epilogue)."""
        return self.objective.per_sequence


N = Normalizer
_SPECS = (
    LossSpec("grpo", CLIPPED, N.SEQUENCE_MEAN),
    LossSpec("bnpo", CLIPPED, N.BATCH_TOKENS),
    LossSpec("dr_grpo", CLIPPED, N.FIXED_LENGTH),
    LossSpec("dapo", CLIPPED, N.TOKEN_COUNT),
    LossSpec("cispo", CISPO, N.TOKEN_COUNT),
    LossSpec("sapo", SAPO, N.SEQUENCE_MEAN),
    LossSpec("luspo", CLIPPED, N.SEQUENCE_SUM),
    LossSpec("vespo", VESPO, N.TOKEN_COUNT),
    LossSpec("gmpo", GMPO, N.SEQUENCE_MEAN, levels=("token",), in_trl=False),
    LossSpec("dppo", DPPO, N.TOKEN_COUNT, levels=("token",), in_trl=False),
)
del N
LOSS_SPECS: dict[str, LossSpec] = {s.name: s for s in _SPECS}

# Every loss type the package computes.
ALL_LOSS_TYPES = tuple(LOSS_SPECS)
# Every loss type with a per-token Triton epilogue (the API test matrices' types).
TOKEN_LOSS_TYPES = tuple(s.name for s in _SPECS if not s.per_sequence)
# TRL 1.16's loss types that the Triton epilogue computes per token (compared with TRL).
LOSS_TYPES = tuple(s.name for s in _SPECS if s.in_trl and not s.per_sequence)
# TRL 1.16's loss types.
TRL_LOSS_TYPES = tuple(s.name for s in _SPECS if s.in_trl)


def spec_of(loss_type: str) -> LossSpec:
    """The spec of `loss_type`; a ValueError naming the known types otherwise."""
    try:
        return LOSS_SPECS[loss_type]
    except (KeyError, TypeError):
        raise ValueError(f"loss_type must be one of {ALL_LOSS_TYPES}, got {loss_type!r}") from None
