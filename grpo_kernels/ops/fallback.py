"""Safety net: a Triton kernel that fails to compile or launch falls back to the chunked PyTorch
path (`grpo_kernels/chunked`, same launcher contract) with one warning, and training goes on.

Only failures of the kernel build or launch fall back: Triton's compile errors (CompilationError,
OutOfResources, PTXASError, ...), and on a GPU any error raised from inside Triton's compiler,
driver or launcher (an MLIR pass failure, a missing ptxas, an API change across Triton releases).
Never input-validation errors (they are raised before a kernel is reached), never errors in our
own code, never the interpreter's report of a kernel bug, never running out of memory (CUDA's
OutOfMemoryError, MemoryError) and never a CUDA error that poisons the context (illegal memory
access, device-side assert, ...): those are re-raised.

What falls back is the variant that failed, named by a key the launch site builds (`variant`):
the kernel family (linear-head or logits), what it computes (forward, backward, or the forward
with the GRPO epilogue of one objective and its option flags), the device type, the input dtype
and the options that select a differently compiled kernel (the head's dtype, bias, the logit
transform, gradient filtering, ...). Sizes are not part of it. A failure of one variant leaves
every other variant on Triton. A backward also runs on the fallback while the plain forward of
the same head options does, so that it runs on the backend its forward ran on.

The transient rule: the call that failed, and the next `RETRY_AFTER` calls of that variant, run
on the fallback; then the kernel is tried once more. If that works the variant is back on Triton
(a transient failure, such as a busy compile cache, costs a few slower calls); if it fails again
the variant stays on the fallback for the rest of the process, so a kernel that cannot be built
costs two compile attempts, not one per call. One `KernelFallbackWarning` per variant names it
and the exception. `fallback_counts` says how many calls of each variant ran on the fallback.
`GRPO_KERNELS_STRICT=1` (or `force_backend("triton")`) raises instead of falling back.
"""


from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
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


# Calls of a failed variant that run on the fallback before its kernel is tried once more.
RETRY_AFTER = 50


# Running out of memory is the user's to see (smaller batch, fewer tokens per micro-batch)
OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))


class KernelFallbackWarning(RuntimeWarning):
    """A Triton kernel failed to compile or launch; the chunked PyTorch path ran instead."""


@dataclass
class _Failure:
    cause: str  # the last failure's exception, in one line
    left: int | None  # calls left on the fallback before the retry; None: never retried


_failed: dict[str, _Failure] = {}  # variant -> its failure, while it runs on the fallback
_counts: dict[str, int] = {}  # variant -> calls that ran on the fallback
_warned: set[str] = set()  # variants whose warning was given


def reset() -> None:
    """Forget earlier failures and counts (tests; or after fixing the environment in a live
    session)."""
    _failed.clear()
    _counts.clear()
    _warned.clear()


def fallback_counts() -> dict[str, int]:
    """{variant key: number of calls that ran on the chunked PyTorch path instead of its failed
    Triton kernel}, since the process started (or `reset`); empty when nothing fell back."""
    return dict(_counts)


def variant(family: str, what: str, device: torch.device, dtype: torch.dtype,
            *options: str) -> str:
    """The key of one kernel variant, e.g. "linear-head/forward+epilogue:cispo+old/cuda/bfloat16/
    bias": family, what it computes, device type, input dtype, then the options (empty ones
    left out) that select a differently compiled kernel."""
    parts = (family, what, device.type, dtype_name(dtype), *options)
    return "/".join(p for p in parts if p)


def dtype_name(dtype: torch.dtype) -> str:
    """The name a variant key gives a dtype: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


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
        if isinstance(e, OUT_OF_MEMORY):
            return None  # a slower path would need memory too: the user must see this
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


def _waiting(failure: _Failure | None) -> bool:
    return failure is not None and (failure.left is None or failure.left > 0)


def use_fallback(key: str, follows: str | None = None) -> bool:
    """Must this call of variant `key` run on the fallback? True while `key` (or the variant it
    `follows`: a backward's plain forward) waits out its failure; the call is counted. False in
    strict mode, and when the failed kernel's retry is due (the caller tries Triton again)."""
    if not _failed or strict():
        return False
    failure = _failed.get(key)
    if _waiting(failure):
        if failure.left is not None:
            failure.left -= 1
    elif not (follows and _waiting(_failed.get(follows))):
        return False
    _counts[key] = _counts.get(key, 0) + 1
    return True


def succeeded(key: str) -> None:
    """The Triton kernel of `key` ran: a variant whose retry worked is back on Triton."""
    if _failed:
        _failed.pop(key, None)


def run(key: str, device: torch.device, on_triton: Callable[[], R], on_torch: Callable[[], R],
        follows: str | None = None) -> R:
    """on_triton(), or on_torch() while variant `key` (or the one it `follows`, see
    `use_fallback`) is on the fallback, or when on_triton fails to compile or launch (see
    `fallback_cause`)."""
    if use_fallback(key, follows):
        return on_torch()
    try:
        result = on_triton()
    except Exception as exc:
        if not note_failure(exc, key, device):
            raise
        return on_torch()
    succeeded(key)
    return result


def note_failure(exc: BaseException, key: str, device: torch.device) -> bool:
    """Records a fallback-worthy failure of variant `key`, counts the call that the caller now
    runs on the fallback, and warns once per variant. Returns False when the caller must
    re-raise: not a compile/launch failure, or strict mode."""
    cause = fallback_cause(exc, on_gpu=device.type == "cuda")
    if cause is None:
        return False
    if strict():
        if hasattr(exc, "add_note"):
            exc.add_note(f"grpo_kernels: {STRICT_ENV}=1 (or force_backend('triton')): not "
                         "falling back to the chunked PyTorch path")
        return False
    retried = key in _failed  # its retry failed too: broken here, never tried again
    _failed[key] = _Failure(cause, None if retried else RETRY_AFTER)
    _counts[key] = _counts.get(key, 0) + 1
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"grpo_kernels: the Triton kernel {key} failed to compile or launch ({cause}); this "
            f"call and the next {RETRY_AFTER} calls of it run on the chunked PyTorch path "
            "instead (slower, same results), then the kernel is tried once more, and if it "
            f"fails again it stays on the chunked path. Set {STRICT_ENV}=1 to raise.",
            KernelFallbackWarning, stacklevel=3,
        )
    return True
