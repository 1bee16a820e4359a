"""Safety net: a Triton kernel that fails to compile or launch falls back to the chunked PyTorch
path (`chunked/launchers.py`, same launcher contract) with one warning, and training goes on.

Only failures of the kernel build or launch fall back: Triton's compile errors (CompilationError,
OutOfResources, PTXASError, ...), and on a GPU any error raised from inside Triton's compiler,
driver or launcher (an MLIR pass failure, a missing ptxas, an API change across Triton releases).
Never input-validation errors (they are raised before a kernel is reached), never errors in our
own code, never the interpreter's report of a kernel bug, and never a CUDA error that poisons the
context (illegal memory access, device-side assert, ...): those are re-raised.

After a failure, every launcher of the same kernel family (linear head or logits) for that dtype
and device type runs on the fallback for the rest of the process, so the warning is printed once
and a failing compile is not retried every step. `GRPO_KERNELS_STRICT=1` (or
`force_backend("triton")`) raises instead of falling back.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from .backends import forced_backend

STRICT_ENV = "GRPO_KERNELS_STRICT"
R = TypeVar("R")

# CUDA errors after which the context is unusable: continuing would compute garbage.
POISON_MARKERS = (
    "illegal memory access", "illegal address", "misaligned address", "device-side assert",
    "unspecified launch failure", "illegal instruction", "hardware stack error",
    "uncorrectable ecc", "out of memory",
)


class KernelFallbackWarning(RuntimeWarning):
    """A Triton kernel failed to compile or launch; the chunked PyTorch path ran instead."""


# (family, dtype, device type) -> the cause of its first failure
_failed: dict[tuple[str, torch.dtype, str], str] = {}


def reset() -> None:
    """Forget earlier failures (tests; or after fixing the environment in a live session)."""
    _failed.clear()


def strict() -> bool:
    """True when failures must raise: GRPO_KERNELS_STRICT=1, or force_backend("triton")."""
    if os.environ.get(STRICT_ENV, "0").strip().lower() not in ("", "0", "false", "no"):
        return True
    return forced_backend() == "triton"


def _triton_error_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(errors that mean "this kernel cannot be built/launched here", the interpreter's error)."""
    fallback, interpreter = [], []
    for module, names in (("triton.compiler.errors", ("CompilationError",)),
                          ("triton.runtime.errors", ("OutOfResources", "PTXASError")),
                          ("triton.runtime.autotuner", ("OutOfResources",))):
        mod = sys.modules.get(module)
        for name in names:
            cls = getattr(mod, name, None)
            if isinstance(cls, type):
                fallback.append(cls)
    mod = sys.modules.get("triton.runtime.errors")
    cls = getattr(mod, "InterpreterError", None)
    if isinstance(cls, type):
        interpreter.append(cls)
    return tuple(fallback), tuple(interpreter)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _raised_in_triton(exc: BaseException) -> bool:
    """Does the traceback reach into the triton package (compiler, driver, launcher)?"""
    import triton

    root = os.path.dirname(os.path.abspath(triton.__file__)) + os.sep
    tb = exc.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(root):
            return True
        tb = tb.tb_next
    return False


def fallback_cause(exc: BaseException, on_gpu: bool) -> str | None:
    """A one-line cause if `exc` is a kernel compile/launch failure to fall back from, else None.

    on_gpu: the kernel ran on a GPU (not in the interpreter). There, any error raised inside
    Triton's own code is a build/launch failure; in the interpreter only Triton's typed compile
    errors are (its InterpreterError reports a bug in the kernel itself).
    """
    if not isinstance(exc, Exception):
        return None
    fallback_types, interpreter_types = _triton_error_types()
    for e in _chain(exc):
        if any(marker in str(e).lower() for marker in POISON_MARKERS):
            return None  # the CUDA context is poisoned, or memory ran out: never hide that
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return None
    for e in _chain(exc):
        if fallback_types and isinstance(e, fallback_types):
            return _describe(e)
    if interpreter_types and isinstance(exc, interpreter_types):
        return None
    if on_gpu and _raised_in_triton(exc):
        return _describe(exc)
    return None


def _describe(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failed(family: str, device: torch.device, dtype: torch.dtype) -> bool:
    """True when this kernel family already failed for (dtype, device type) and falls back."""
    return not strict() and (family, dtype, device.type) in _failed


def run(family: str, device: torch.device, dtype: torch.dtype, what: str,
        on_triton: Callable[[], R], on_torch: Callable[[], R]) -> R:
    """on_triton(), or on_torch() if the family already failed or on_triton fails to compile or
    launch (see `fallback_cause`); `what` names the kernel in the warning."""
    if failed(family, device, dtype):
        return on_torch()
    try:
        return on_triton()
    except Exception as exc:
        if not note_failure(exc, family, device, dtype, what):
            raise
    return on_torch()


def note_failure(exc: BaseException, family: str, device: torch.device, dtype: torch.dtype,
                 what: str) -> bool:
    """Records a fallback-worthy failure and warns (once per family, dtype and device type).
    Returns False when the caller must re-raise: not a compile/launch failure, or strict mode."""
    cause = fallback_cause(exc, on_gpu=device.type == "cuda")
    if cause is None:
        return False
    if strict():
        if hasattr(exc, "add_note"):
            exc.add_note(f"grpo_kernels: {STRICT_ENV}=1 (or force_backend('triton')): not "
                         "falling back to the chunked PyTorch path")
        return False
    key = (family, dtype, device.type)
    if key not in _failed:
        _failed[key] = cause
        warnings.warn(
            f"grpo_kernels: the Triton {what} kernel failed to compile or launch for {dtype} on "
            f"{device.type} ({cause}); this and later calls of the {family} kernels run on the "
            f"chunked PyTorch path instead (slower, same results). Set {STRICT_ENV}=1 to raise.",
            KernelFallbackWarning, stacklevel=3,
        )
    return True
