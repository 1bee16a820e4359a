"""GRPO hyperparameters: one frozen dataclass, the single source of every setting.

Everything else derives from `GRPOParams`: the keyword arguments of the public functions and
modules (`signature_with_params`), the mapping from a trainer's configuration (`from_config`,
used by grpo_train and the TRL subclass), and `TokenLossArgs`, the few values the per-token loss
reads (the Triton epilogue's scalars and flags), which is all a token-terms custom operator
takes (`TokenLossArgs.op_schema`). Names and defaults are TRL's; the semantics of each field are
in docs/semantics.md.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar

from .loss_specs import (  # noqa: F401
    ALL_LOSS_TYPES,
    LOSS_TYPES,
    TOKEN_LOSS_TYPES,
    TRL_LOSS_TYPES,
    LossSpec,
    Normalizer,
    spec_of,
)

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def is_finite(value) -> bool:
    """math.isfinite for a Python number, written so that torch.compile can also trace it on a
    symbolic number (a hyperparameter or a count that changes between calls of a compiled step,
    which math.isfinite cannot take)."""
    return value == value and abs(value) != math.inf


# float32's largest finite number and its smallest normal one. The hyperparameters and the logit
# transform enter float32 arithmetic (the kernels, the per-token math): a larger value is inf
# there (a clamp bound of 1e39 fails to convert, a temperature of 1e300 gives NaN), and a divisor
# (temperature, softcap, a sapo temperature) below the smallest normal one has no finite inverse
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


def in_float32_range(value) -> bool:
    """A finite number that float32 holds as a finite number (|value| <= FLOAT32_MAX); traceable
    on a symbolic number, as `is_finite`."""
    return is_finite(value) and abs(value) <= FLOAT32_MAX


def _check_finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):  # np.float32 is neither
        raise ValueError(f"{name} must be a finite number (a Python int or float), got "
                         f"{value!r} of type {type(value).__name__}")
    if not in_float32_range(value):
        raise ValueError(f"{name} must be a finite number within float32's range "
                         f"(|{name}| <= 3.4e38), got {value!r}")


def _check_divisor(name: str, value: float, why: str) -> None:
    """> 0, and at least float32's smallest normal number: its inverse stays finite."""
    if value < FLOAT32_TINY:
        raise ValueError(f"{name} must be > 0 ({why}; at least 1.2e-38, float32's smallest "
                         f"normal number), got {value!r}")


@dataclass(frozen=True)
class GRPOParams:
    """Hyperparameters of the GRPO loss (TRL names and defaults)."""

    beta: float = 0.0  # weight of the k3 KL penalty; 0 disables it (no ref_logps needed)
    # lower clip: ratio >= 1 - epsilon_low (gmpo: log-ratio >= -epsilon_low; dppo: the
    # probability may fall by at most epsilon_low)
    epsilon_low: float = 0.2
    # upper clip (None: epsilon_low, resolved at construction, as TRL's trainer resolves it);
    # cispo: the raw cap; gmpo: log-ratio <= epsilon_high; dppo: the probability may rise by at
    # most epsilon_high
    epsilon_high: float | None = None
    # two-sided clipping: ratio capped at delta in the unclipped term (dppo: the cap of its
    # detached ratio coefficient, truncated importance sampling)
    delta: float | None = None
    temperature: float = 1.0  # policy logits are divided by this before the softmax
    loss_type: str = "dapo"  # one of ALL_LOSS_TYPES (loss_specs.py)
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO)
    max_completion_length: int | None = None  # dr_grpo's fixed normalizer
    use_bias_correction_kl: bool = True  # the k3 KL times the importance ratio (as TRL)
    entropy_coef: float = 0.0  # loss -= entropy_coef * mean entropy (needs entropy grads)
    sapo_temperature_pos: float = 1.0  # SAPO soft-gate temperature for A > 0
    sapo_temperature_neg: float = 1.05  # SAPO soft-gate temperature for A <= 0
    vespo_k_pos: float = 2.0  # vespo's power of the sequence ratio for A >= 0
    vespo_lambda_pos: float = 3.0  # vespo's decay rate of the sequence ratio for A >= 0
    vespo_k_neg: float = 3.0  # the same two for A < 0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0  # policy loss on the top fraction of tokens by entropy
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences drifted beyond this

    def __post_init__(self) -> None:
        if self.epsilon_high is None:  # one upper clip from here on (frozen: set it directly)
            object.__setattr__(self, "epsilon_high", self.epsilon_low)
        spec = spec_of(self.loss_type)
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                "importance_sampling_level must be one of "
                f"{IMPORTANCE_SAMPLING_LEVELS}, got {self.importance_sampling_level!r}"
            )
        if self.importance_sampling_level not in spec.levels:
            raise ValueError(f"loss_type={self.loss_type!r} is defined at importance_sampling_level"
                             f" {' or '.join(map(repr, spec.levels))}, got "
                             f"{self.importance_sampling_level!r}")
        for name in ("beta", "epsilon_low", "temperature", "entropy_coef",
                     "sapo_temperature_pos", "sapo_temperature_neg", "top_entropy_quantile",
                     *VESPO_FIELDS):
            _check_finite(name, getattr(self, name))
        for name in ("epsilon_high", "off_policy_mask_threshold"):
            if getattr(self, name) is not None:
                _check_finite(name, getattr(self, name))
        if not isinstance(self.use_bias_correction_kl, bool):  # "False" would be truthy
            raise TypeError("use_bias_correction_kl must be a bool, got "
                            f"{self.use_bias_correction_kl!r}")
        if self.epsilon_low < 0 or self.epsilon_high < 0:
            raise ValueError(
                "epsilon_low and epsilon_high must be >= 0, "
                f"got {self.epsilon_low}, {self.epsilon_high}"
            )
        if self.beta < 0:  # a negative KL weight would reward drifting from the reference
            raise ValueError(f"beta must be >= 0 (the KL weight; 0 turns the KL term off), "
                             f"got {self.beta}")
        _check_divisor("temperature", self.temperature, "the logits are divided by it")
        if self.delta is not None:
            _check_finite("delta", self.delta)
            if self.delta <= 0:
                raise ValueError(f"delta must be > 0 (a cap on the ratio), got {self.delta}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            _check_divisor(name, getattr(self, name), "sapo's gate divides by it")
        self._check_options()
        if spec.normalizer.needs_max_completion_length and self.max_completion_length is None:
            raise ValueError(f"loss_type={self.loss_type!r} needs max_completion_length (its "
                             "normalizer)")
        if spec.objective.one_loss_per_sequence and self.top_entropy_quantile < 1.0:
            raise ValueError(f"loss_type={self.loss_type!r} has one loss per sequence; "
                             "top_entropy_quantile < 1 selects tokens: use them apart")
        if self.max_completion_length is not None:
            m = self.max_completion_length
            if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
                raise ValueError(f"max_completion_length must be a positive int (a Python int), "
                                 f"got {m!r}")

    def _check_options(self) -> None:
        """The sequence and batch options (docs/semantics.md, "Sequence and batch options")."""
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError("top_entropy_quantile must be in [0, 1] (the fraction of tokens "
                             f"kept), got {self.top_entropy_quantile}")
        for name in VESPO_FIELDS:
            value = getattr(self, name)
            if name.startswith("vespo_k") and value < 0:
                raise ValueError(f"{name} must be >= 0 (a power of the ratio), got {value}")
            if name.startswith("vespo_lambda") and value <= 0:
                raise ValueError(f"{name} must be > 0 (a decay rate), got {value}")

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def resolve(cls, params: GRPOParams | None, hyperparameters: dict) -> GRPOParams:
        """`params` or GRPOParams(**hyperparameters): what a public function was given.

        Giving both, or a keyword that is not a field, raises a TypeError naming it."""
        unknown = [name for name in hyperparameters if name not in FIELD_NAMES]
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the GRPO "
                            f"hyperparameters are {', '.join(FIELD_NAMES)}")
        if params is None:
            return cls(**hyperparameters)
        if not isinstance(params, GRPOParams):
            raise TypeError(f"params must be a GRPOParams, got {type(params).__name__}")
        if hyperparameters:
            raise TypeError("give either params= or hyperparameter keywords, not both "
                            f"(got params and {', '.join(hyperparameters)})")
        return params

    @classmethod
    def from_config(cls, *sources, **overrides) -> GRPOParams:
        """From objects with attributes of these names (a trainer, its config): each field from
        `overrides`, else the first source that has it, else the default. Whole numbers given
        for float fields become floats (the custom ops' schema types them)."""
        values = {}
        for f in fields(cls):
            source = next((s for s in sources if hasattr(s, f.name)), None)
            if f.name in overrides:
                value = overrides[f.name]
            elif source is not None:
                value = getattr(source, f.name)
            else:
                continue
            if f.type.startswith("float") and isinstance(value, int) and not isinstance(
                    value, bool):
                value = float(value)
            values[f.name] = value
        unknown = sorted(set(overrides) - set(FIELD_NAMES))
        if unknown:
            raise TypeError(f"unexpected GRPOParams field {unknown[0]!r}")
        return cls(**values)

    # ---- derived quantities ---------------------------------------------------------------

    @property
    def clip_range(self) -> tuple[float, float]:
        """(1 - epsilon_low, 1 + epsilon_high): the trust region of the clipped ratio."""
        return 1.0 - self.epsilon_low, 1.0 + self.epsilon_high

    @property
    def spec(self) -> LossSpec:
        """The loss type's registry entry (`loss_specs.py`)."""
        return spec_of(self.loss_type)

    @property
    def token_loss_args(self) -> TokenLossArgs:
        """The values the per-token loss of a token-level type reads (see TokenLossArgs)."""
        return TokenLossArgs(self.loss_type, self.epsilon_low, self.epsilon_high, self.delta,
                             self.beta, self.use_bias_correction_kl, self.sapo_temperature_pos,
                             self.sapo_temperature_neg)

    @property
    def needs_whole_sequences(self) -> bool:
        """Options that need every token of a sequence or of the batch before any token's loss
        (GSPO ratios, per-sequence loss types such as vespo and gmpo, the off-policy mask, the
        entropy quantile): no per-token epilogue."""
        return (self.importance_sampling_level == "sequence" or self.spec.per_sequence
                or self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1.0)

    @property
    def normalizes_by_token_count(self) -> bool:
        """Divided by the step's completion-token count (num_items_in_batch): dapo, cispo,
        vespo, dppo."""
        return self.spec.normalizer is Normalizer.TOKEN_COUNT


VESPO_FIELDS = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
FIELD_NAMES = tuple(f.name for f in fields(GRPOParams))

# Field annotation -> torch.library schema type (the annotations are strings: `from __future__`).
# Floats travel as 0-d float64 tensors, so that a compiled step takes a new value without a
# recompile (ops/op_scalars.py).
_SCHEMA_TYPES = {"float": "Tensor", "float | None": "Tensor?", "str": "str", "bool": "bool"}


@dataclass(frozen=True)
class TokenLossArgs:
    """What ℓ of a token-level loss type reads, and nothing else: the Triton epilogue's scalars
    and flags (`kernels.epilogue.epilogue_args`), the hyperparameter arguments of the token-terms
    custom operators, and what `grpo_math.per_token_loss` reads on their chunked path. Built
    from a validated GRPOParams (`GRPOParams.token_loss_args`), once per call; the operator
    gets it as arguments (`to_op_args`, in `op_schema`'s order; the floats as 0-d tensors on
    the operator call, ops/op_scalars.py) and rebuilds it (`of_op_args`, from Python values).
    Its attribute names are GRPOParams', so grpo_math reads either."""

    loss_type: str  # a type with a per-token epilogue (its spec's kernel_code is set)
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    use_bias_correction_kl: bool
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    importance_sampling_level: ClassVar[str] = "token"  # the token-terms ops are token level

    def __post_init__(self) -> None:
        if self.spec.kernel_code is None:
            raise ValueError(f"loss_type={self.loss_type!r} has no per-token epilogue (its loss "
                             "needs whole sequences)")

    @property
    def spec(self) -> LossSpec:
        return spec_of(self.loss_type)

    @property
    def clip_range(self) -> tuple[float, float]:
        return 1.0 - self.epsilon_low, 1.0 + self.epsilon_high

    def to_op_args(self) -> tuple:
        # the fields as they are: dataclasses.astuple deep-copies each, and under torch.compile
        # the copy's memo guards each float on its object id (a recompile per new value)
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def of_op_args(cls, values) -> TokenLossArgs:
        return cls(*values)

    @classmethod
    def op_schema(cls) -> str:
        """Its part of an operator schema, e.g. "str loss_type, float epsilon_low, ..."."""
        return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in fields(cls))


def signature_with_params(fn):
    """Declares GRPOParams' fields as keyword-only parameters in `fn`'s signature (for help()
    and IDEs); `fn` itself takes them as **hyperparameters and is returned unchanged."""
    sig = inspect.signature(fn)
    kept = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                               default=None if f.default is MISSING else f.default,
                               annotation=f.type)
             for f in fields(GRPOParams)]
    fn.__signature__ = sig.replace(parameters=kept + extra)
    return fn
