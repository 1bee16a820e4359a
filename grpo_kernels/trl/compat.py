"""Construction-time check that the installed TRL still has what `GRPOTrainer` relies on.

`grpo_kernels.trl.GRPOTrainer` subclasses TRL's GRPOTrainer (written against TRL 1.16): it
overrides two private methods, calls them through super(), and reads attributes that TRL's
constructor (or transformers' training loop) sets. A TRL release that renames one of them
would otherwise surface as an AttributeError or TypeError in the middle of training, or, for
the loss hyperparameters (read by name, with defaults), not at all. The check runs when the
trainer is built and raises `TRLCompatibilityError`, naming the TRL version and the method or
attribute, instead of falling back: a fallback could not say which numbers it would change.

- Methods (before TRL's constructor runs, so before any model is loaded): each overridden
  method exists on TRL's class with exactly TRL 1.16's parameter names, in order. A parameter
  added, removed or renamed fails: TRL's callers would pass arguments our override does not
  take, or our super() calls would pass ones TRL's method no longer has.
- Attributes (after TRL's constructor): the trainer's attributes, its config's fields, and
  each GRPOParams field read by `GRPOParams.from_config` from the trainer or its config.
- Attributes set only by the training loop (`current_gradient_accumulation_steps`): the
  source of a class in the trainer's MRO must assign it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import re
import sys

from ..params import FIELD_NAMES

# Parameter names after `self`, as TRL 1.16 declares them.
METHODS = {
    "_compute_loss": ("model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
        "compute_entropy", "compute_aux_loss",
        # the multimodal keywords: model_inputs.MULTIMODAL_KEYS, passed to the model body
        "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
        "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
        "image_position_ids"),
}

# Set by TRL's (or transformers') constructor, read by the subclass.
TRAINER_ATTRIBUTES = (
    "accelerator", "args", "model", "is_fsdp_enabled", "_metrics", "loss_type",
    "top_entropy_quantile", "off_policy_mask_threshold", "use_adaptive_entropy",
    "aux_loss_enabled", "_entropy_bonus_enabled", "entropy_coef", "use_vllm",
    "vllm_importance_sampling_correction", "temperature",
    "_last_world_entropy", "_entropy_window_stats",  # the adaptive entropy controller's state
)

# GRPOConfig fields read directly from trainer.args.
CONFIG_FIELDS = ("cast_lm_head_to_fp32", "steps_per_generation",
                 # the adaptive entropy controller's settings (grpo_options.EntropyController)
                 "entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")

# Set by transformers' training loop, not by a constructor; read by `_compute_loss`.
TRAINING_LOOP_ATTRIBUTES = ("current_gradient_accumulation_steps",)

# GRPOParams fields the subclass does not take from TRL (the trainer adds the entropy bonus).
NOT_FROM_TRL = ("entropy_coef",)


class TRLCompatibilityError(RuntimeError):
    """The installed TRL lacks, or has changed, something grpo_kernels.trl.GRPOTrainer uses."""


def trl_version() -> str:
    """The installed TRL's version string ("unknown" if it has no distribution metadata)."""
    module = sys.modules.get("trl")
    version = getattr(module, "__version__", None)
    if version:
        return version
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _fail(version: str, what: str) -> TRLCompatibilityError:
    return TRLCompatibilityError(
        f"grpo_kernels.trl.GRPOTrainer was written against TRL 1.16, and TRL {version} {what}. "
        "Install a TRL it supports (pip install 'trl>=1.16,<1.17') or use trl.GRPOTrainer")


def check_methods(trl_class: type, version: str | None = None) -> None:
    """Raises TRLCompatibilityError unless each method in METHODS exists on `trl_class` with
    exactly the parameter names (after self) listed there, in that order."""
    version = version or trl_version()
    name = trl_class.__name__
    for method, expected in METHODS.items():
        fn = getattr(trl_class, method, None)
        if not callable(fn):
            raise _fail(version, f"has no method {name}.{method}")
        params = [p.name for p in inspect.signature(fn).parameters.values()][1:]  # minus self
        if tuple(params) != expected:
            raise _fail(version, f"changed the signature of {name}.{method}: it takes "
                        f"({', '.join(params)}), expected ({', '.join(expected)})")


def _assigned_in_source(cls: type, attribute: str) -> bool:
    """Whether the module of some class in cls.__mro__ assigns self.<attribute>."""
    pattern = re.compile(rf"\bself\.{re.escape(attribute)}\s*=[^=]")
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or klass is object:
            continue
        try:
            if pattern.search(inspect.getsource(module)):
                return True
        except (OSError, TypeError):  # no source (compiled or frozen): assume it is there
            return True
    return False


def check_attributes(trainer, version: str | None = None) -> None:
    """Raises TRLCompatibilityError unless `trainer` (built by TRL's constructor) has each of
    TRAINER_ATTRIBUTES, its config each of CONFIG_FIELDS, one of the two each GRPOParams field,
    and the training loop of its classes assigns each of TRAINING_LOOP_ATTRIBUTES."""
    version = version or trl_version()
    name = type(trainer).__name__
    for attribute in TRAINER_ATTRIBUTES:
        if not hasattr(trainer, attribute):
            raise _fail(version, f"no longer sets the attribute {name}.{attribute}")
    config = trainer.args
    for field in CONFIG_FIELDS:
        if not hasattr(config, field):
            raise _fail(version, f"has no config field {type(config).__name__}.{field}")
    for field in FIELD_NAMES:
        if field not in NOT_FROM_TRL and not (hasattr(trainer, field) or hasattr(config, field)):
            # GRPOParams.from_config would silently use its own default for it
            raise _fail(version, f"has neither {name}.{field} nor the config field "
                        f"{type(config).__name__}.{field} (a loss hyperparameter)")
    for attribute in TRAINING_LOOP_ATTRIBUTES:
        if not _assigned_in_source(type(trainer), attribute):
            raise _fail(version, f"no longer sets {name}.{attribute} in its training loop")


@contextlib.contextmanager
def trl_checked(trainer, trl_class: type):
    """Around TRL's constructor: methods checked on entry (before any model is loaded), the
    trainer's attributes on a normal exit."""
    version = trl_version()
    check_methods(trl_class, version)
    yield
    check_attributes(trainer, version)
