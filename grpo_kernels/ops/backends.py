"""The backend registry and dispatch: which launchers run a selective log-prob op.

Backends: "triton" (CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set before triton was
imported) and "chunked" (the chunked PyTorch path, `grpo_kernels/chunked`). Both implement the
same four launchers (linear-head and logits forward/backward) and save only per-token
statistics (lse, entropy) for backward, never logits (see `autograd.py`; the one exception, a
small problem's single tile on the chunked path in eager mode, is in
`custom_ops._LinearLogprobs`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from .. import chunked
from ..kernels import linear_backward_atomic, linear_backward_gemm
from ..kernels import linear_logprobs as triton_impl
from ..kernels import logits_logprobs as logits_impl
from ..kernels.tile_configs import INTERPRET

BACKENDS = ("triton", "chunked")
# Former names a caller may still pass: force_backend and grpo_train's --backend map them (with a
# FutureWarning) to the backend's one name.
FORMER_NAMES = {"torch": "chunked"}
# The Triton backwards of the linear head (cost model: docs/benchmarks.md). "gemm" (default):
# d logits per chunk + GEMMs, no atomics, deterministic. "atomic": every tile adds its products
# with float32 atomics (not deterministic); with grad_filter it skips the products of dropped
# tiles, the one case the cost model says it can be faster.
LINEAR_BACKWARDS = {
    "gemm": linear_backward_gemm.linear_logprob_backward_gemm,
    "atomic": linear_backward_atomic.linear_logprob_backward_atomic,
}
BACKWARD_ENV = "GRPO_KERNELS_LINEAR_BACKWARD"  # "auto" (unset), "gemm" or "atomic"


def linear_backward_mode(grad_filter: float | None) -> str:
    """The Triton linear-head backward to run: GRPO_KERNELS_LINEAR_BACKWARD if set, else
    "atomic" when gradient filtering is on with eps > 0 (only there does it save work) and
    "gemm" otherwise (eps = 0 drops only all-zero tiles: exact, and "gemm" gives it bitwise).

    Under torch.use_deterministic_algorithms(True) the automatic choice is always "gemm" (which
    honours grad_filter with the same numbers); an explicit "atomic" raises RuntimeError, or
    with warn_only=True warns and runs, as PyTorch does for its own nondeterministic ops."""
    mode = os.environ.get(BACKWARD_ENV, "auto") or "auto"
    if mode not in ("auto", *LINEAR_BACKWARDS):
        raise ValueError(f"{BACKWARD_ENV} must be one of {['auto', *sorted(LINEAR_BACKWARDS)]}, "
                         f"got {mode!r}")
    deterministic = torch.are_deterministic_algorithms_enabled()
    if mode == "auto":
        return "atomic" if grad_filter and not deterministic else "gemm"
    if mode == "atomic" and deterministic:
        msg = (f"{BACKWARD_ENV}=atomic adds gradients with float32 atomics, which is not "
               "deterministic, but torch.use_deterministic_algorithms(True) is on; unset "
               f"{BACKWARD_ENV} (or set it to 'gemm') for the deterministic backward")
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(msg)
        warnings.warn(msg, stacklevel=3)
    return mode


def _linear_backward(*args, grad_filter=None, **kwargs):
    mode = linear_backward_mode(grad_filter)
    return LINEAR_BACKWARDS[mode](*args, grad_filter=grad_filter, **kwargs)


# The launchers of both ops per backend, under the same four names.
IMPLS = {
    "triton": SimpleNamespace(
        linear_logprob_forward=triton_impl.linear_logprob_forward,
        linear_logprob_backward=_linear_backward,
        logits_logprob_forward=logits_impl.logits_logprob_forward,
        logits_logprob_backward=logits_impl.logits_logprob_backward,
    ),
    "chunked": chunked,
}
_forced: str | None = None


def forced_backend() -> str | None:
    """The backend `force_backend` pins for the enclosed calls, or None (dispatch by device)."""
    return _forced


@contextlib.contextmanager
def force_backend(name: str | None) -> Iterator[None]:
    """Run the enclosed calls on one backend ("triton" or "chunked"); None restores dispatch."""
    global _forced
    name = backend_name(name)
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def backend_for(x: torch.Tensor) -> str:
    """CUDA -> Triton; CPU -> the Triton interpreter if enabled, else chunked PyTorch."""
    triton_ok = x.is_cuda or (x.device.type == "cpu" and INTERPRET)
    if x.dtype == torch.float64:
        triton_ok = False  # the kernels take 16- and 32-bit floats; float64 stays in PyTorch
    if _forced is not None:
        if _forced == "triton" and not triton_ok:
            why = ("the kernels take float16, bfloat16 and float32; float64 runs on the chunked "
                   "backend" if x.dtype == torch.float64
                   else "CPU needs TRITON_INTERPRET=1 set before triton is imported")
            raise RuntimeError(f"backend 'triton' cannot run {x.dtype} tensors on {x.device} "
                               f"({why})")
        return _forced
    return "triton" if triton_ok else "chunked"


def backend_name(name):
    """`name`, or the backend's one name for a former name (with a FutureWarning)."""
    if isinstance(name, str) and name in FORMER_NAMES:
        new = FORMER_NAMES[name]
        warnings.warn(f"backend {name!r} is now called {new!r}; the old name will be removed",
                      FutureWarning, stacklevel=3)
        return new
    return name
