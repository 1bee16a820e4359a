"""Loss types: one registry entry each, read by every decision that depends on the type.

A `LossSpec` says, for one `loss_type`:

    objective    which formula of `grpo_math.per_token_loss` computes ℓ (several types share
                 one: the PPO-style clipped surrogate is grpo's, bnpo's, dr_grpo's, dapo's and
                 luspo's)
    normalizer   how the token losses are summed into the loss (`grpo_math.token_weights`):
                   sequence_mean   mean over sequences of each sequence's token mean
                   batch_tokens    over the micro-batch's completion tokens
                   fixed_length    over sequences × max_completion_length
                   token_count     over the step's completion tokens (num_items_in_batch)
                   sequence_sum    mean over sequences of each sequence's token sum
    kernel_code  the Triton epilogue's LOSS_KIND for the objective (`kernels/epilogue.py`), or
                 None where ℓ needs a whole sequence (the per-sequence route of grpo_math)
    levels       the importance-sampling levels it is defined at
    clip_flags   the names of its clip metrics (`grpo_math.clip_indicators`)
    in_trl       whether TRL 1.16's GRPOTrainer has it (the TRL subclass refuses the rest)

The formulas are in docs/semantics.md. An unknown name is an error wherever it is looked up
(`spec_of`); nothing falls through to a default.
"""

from __future__ import annotations

from dataclasses import dataclass

# The Triton epilogue's LOSS_KIND codes (kernels/epilogue.py branches on these names).
KERNEL_CLIPPED = 0
KERNEL_CISPO = 1
KERNEL_SAPO = 2
KERNEL_DPPO = 3

NORMALIZERS = ("sequence_mean", "batch_tokens", "fixed_length", "token_count", "sequence_sum")
CLIP_FLAGS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CISPO_FLAG = "cispo_clip_ratio"


@dataclass(frozen=True)
class LossSpec:
    name: str
    objective: str
    normalizer: str
    kernel_code: int | None
    levels: tuple[str, ...] = ("token", "sequence")
    clip_flags: tuple[str, ...] = CLIP_FLAGS
    in_trl: bool = True

    @property
    def clips(self) -> bool:
        """Whether its objective keeps the ratio in a trust region (clip flags are logged)."""
        return bool(self.clip_flags)

    @property
    def per_sequence(self) -> bool:
        """Whether ℓ needs every token of its sequence first (no per-token epilogue)."""
        return self.kernel_code is None


_SPECS = (
    LossSpec("grpo", "clipped", "sequence_mean", KERNEL_CLIPPED),
    LossSpec("bnpo", "clipped", "batch_tokens", KERNEL_CLIPPED),
    LossSpec("dr_grpo", "clipped", "fixed_length", KERNEL_CLIPPED),
    LossSpec("dapo", "clipped", "token_count", KERNEL_CLIPPED),
    LossSpec("cispo", "cispo", "token_count", KERNEL_CISPO, clip_flags=(CISPO_FLAG,)),
    LossSpec("sapo", "sapo", "sequence_mean", KERNEL_SAPO, clip_flags=()),
    LossSpec("luspo", "clipped", "sequence_sum", KERNEL_CLIPPED),
    LossSpec("vespo", "vespo", "token_count", None, clip_flags=()),
    # geometric mean of the clipped token ratios per sequence (GMPO; verl's "geo_mean")
    LossSpec("gmpo", "gmpo", "sequence_mean", None, levels=("token",), in_trl=False),
    # binary total-variation trust-region mask (DPPO-Binary-TV; prime-rl's default objective)
    LossSpec("dppo", "dppo", "token_count", KERNEL_DPPO, levels=("token",), in_trl=False),
)
LOSS_SPECS: dict[str, LossSpec] = {s.name: s for s in _SPECS}

# Every loss type the package computes.
ALL_LOSS_TYPES = tuple(LOSS_SPECS)
# TRL 1.16's loss types that the Triton epilogue computes per token (the test matrices' types).
LOSS_TYPES = tuple(s.name for s in _SPECS if s.in_trl and not s.per_sequence)
# TRL 1.16's loss types.
TRL_LOSS_TYPES = tuple(s.name for s in _SPECS if s.in_trl)


def spec_of(loss_type: str) -> LossSpec:
    """The spec of `loss_type`; a ValueError naming the known types otherwise."""
    try:
        return LOSS_SPECS[loss_type]
    except (KeyError, TypeError):
        raise ValueError(f"loss_type must be one of {ALL_LOSS_TYPES}, got {loss_type!r}") from None
