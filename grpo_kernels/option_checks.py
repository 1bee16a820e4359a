"""Checks of the scalar options of the public functions: flags, the temperature, the logit
transform (softcap, logit_scale) and grad_filter. Each error names the option and what it takes.

The numbers enter float32 arithmetic in the kernels and the chunked path, so each must be
finite in float32 too (`params.FLOAT32_MAX`), and a divisor (the temperature, the softcap) at
least float32's smallest normal number (`params.FLOAT32_TINY`): beyond those the backends
would give NaN, or fail inside (a factor that float32 cannot hold).
The tensor checks are `validation.py`'s."""

from __future__ import annotations

import math

import torch

from .params import FLOAT32_MAX, FLOAT32_TINY, in_float32_range


def check_flags(**flags) -> None:
    """Each keyword a Python bool ("False" reads as true: inplace="False" overwrote logits)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def check_entropy_gather(entropy_gather) -> None:
    """None or a function (`grpo_options.high_entropy_mask` calls it with top_entropy_quantile
    < 1; anything else failed there as "'int' object is not callable")."""
    if entropy_gather is not None and not callable(entropy_gather):
        raise TypeError("entropy_gather must be None or a function that maps this process's "
                        "entropies [M] to every process's, got "
                        f"{type(entropy_gather).__name__}")


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (in_float32_range(temperature) and temperature >= FLOAT32_TINY):
        raise ValueError("temperature must be a finite number > 0 (from 1.2e-38 to 3.4e38, "
                         "float32's normal range: the logits are divided by it in float32), "
                         f"got {temperature}")
    return float(temperature)


def _number_or_none(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
    if not in_float32_range(value):
        raise ValueError(f"{name} must be finite, and so in float32 (|{name}| <= 3.4e38), "
                         f"got {value}")
    return float(value)


def check_logit_transform(softcap, logit_scale, temperature: float | None = None
                          ) -> tuple[float | None, float | None]:
    """(softcap, logit_scale) as floats or None: the logit transform z = c·tanh(s·y / c) (s = 1
    without a scale; z = s·y without a cap) applied to the raw logits y before the temperature
    τ. softcap must be finite and > 0 (Gemma 2's final_logit_softcapping); logit_scale finite
    and non-zero (Cohere's logit_scale); with a (checked) temperature given, the factors the
    kernels apply, s/c and c/τ (s/τ without a cap), normal float32 numbers (`_check_factors`;
    a module checks them at its forward, where its temperature meets them)."""
    softcap = _number_or_none("softcap", softcap)
    if softcap is not None and not softcap >= FLOAT32_TINY:
        raise ValueError(f"softcap must be > 0 (z = softcap·tanh(y / softcap); at least 1.2e-38, "
                         f"float32's smallest normal number), got {softcap}")
    logit_scale = _number_or_none("logit_scale", logit_scale)
    if logit_scale == 0:
        raise ValueError("logit_scale must be non-zero (z = logit_scale·y), got 0.0")
    if temperature is not None and (softcap is not None or logit_scale is not None):
        _check_factors(softcap, logit_scale, temperature)
    return softcap, logit_scale


LOG2E = 1.4426950408889634  # the kernels take the softmax in log2 units: z/τ times log2(e)


def _check_factors(softcap, logit_scale, temperature) -> None:
    """The kernels multiply the raw logits y by s·log2(e)/τ without a cap; with one, by s/c
    inside the tanh and c·log2(e)/τ outside. Each factor must be a normal float32 number: a
    larger one is inf (the chunked path cannot convert it), a smaller one is flushed to 0 by
    the Triton kernels (at softcap = 3.4e38 they would give uniform log-probs, the chunked path
    NaN)."""
    s = "1" if logit_scale is None else "|logit_scale|"
    scale = 1.0 if logit_scale is None else abs(logit_scale)
    if softcap is None:
        factors = {f"{s} / temperature": scale / temperature}
    else:
        factors = {f"{s} / softcap": scale / softcap,
                   "softcap / temperature": softcap / temperature}
    for name, factor in factors.items():
        if not FLOAT32_TINY <= factor * LOG2E <= FLOAT32_MAX:
            raise ValueError(
                f"the logit transform's factor {name} = {factor:.3g} (softcap={softcap}, "
                f"logit_scale={logit_scale}, temperature={temperature}) must lie in float32's "
                "normal range (1.2e-38 to 3.4e38, times log2(e) = 1.44 in the kernels)")


def check_grad_filter(grad_filter, dtype: torch.dtype) -> float | None:
    """None (exact), "auto" (finfo(dtype).eps / 32: 2^-12 for bfloat16, as Cut Cross-Entropy's
    default) or a number >= 0 -> the eps the backward kernel takes, or None."""
    if grad_filter is None:
        return None
    if isinstance(grad_filter, str):
        if grad_filter != "auto":
            raise ValueError(f'grad_filter must be None, "auto" or a number >= 0, '
                             f"got {grad_filter!r}")
        return torch.finfo(dtype).eps / 32
    if (isinstance(grad_filter, bool) or not isinstance(grad_filter, (int, float))
            or not math.isfinite(grad_filter) or grad_filter < 0):
        raise ValueError(f'grad_filter must be None, "auto" or a finite number >= 0, '
                         f"got {grad_filter!r}")
    return float(grad_filter)
