"""Differentiable selective log-prob (and entropy) of a linear head, and backend dispatch.

Backends: "triton" (CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set before triton was
imported) and "torch" (the chunked PyTorch path in `chunked.py`). Both save only per-token
statistics (lse, entropy) for backward, never logits (see `autograd.py`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from . import chunked, custom_ops, linear_backward_gemm
from . import linear_logprobs as triton_impl
from . import logits_logprobs as logits_impl
from .validation import (
    check_grad_filter,
    check_linear_head,
    check_temperature,
    check_token_ids,
)

BACKENDS = ("triton", "torch")
# The Triton backwards of the linear head (cost model: benchmarks/NOTES.md). "gemm" (default):
# d logits per chunk + GEMMs, no atomics, deterministic. "atomic": every tile adds its products
# with float32 atomics (not deterministic); with grad_filter it skips the products of dropped
# tiles, the one case the cost model says it can be faster.
LINEAR_BACKWARDS = {
    "gemm": linear_backward_gemm.linear_logprob_backward_gemm,
    "atomic": triton_impl.linear_logprob_backward,
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
    "torch": chunked,
}
_forced: str | None = None


@contextlib.contextmanager
def force_backend(name: str | None) -> Iterator[None]:
    """Run the enclosed calls on one backend ("triton" or "torch"); None restores dispatch."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def backend_for(x: torch.Tensor) -> str:
    """CUDA -> Triton; CPU -> the Triton interpreter if enabled, else chunked PyTorch."""
    triton_ok = x.is_cuda or (x.device.type == "cpu" and triton_impl.INTERPRET)
    if x.dtype == torch.float64:
        triton_ok = False  # the kernels take 16- and 32-bit floats; float64 stays in PyTorch
    if _forced is not None:
        if _forced == "triton" and not triton_ok:
            raise RuntimeError(
                f"backend 'triton' cannot run {x.dtype} tensors on {x.device} (CPU needs "
                "TRITON_INTERPRET=1 set before triton is imported)"
            )
        return _forced
    return "triton" if triton_ok else "torch"


def linear_logprobs_2d(hidden, weight, bias, targets, temperature, backend, grad_filter=None,
                       ids_name="targets"):
    """[N, D] hidden and int64 [N] targets -> (logp, entropy), each [N], through the custom
    operator grpo_kernels::linear_logprobs (which checks the id range)."""
    logp, ent, _ = custom_ops.OPS.linear_logprobs(
        *linear_inputs(hidden, weight, bias), targets, temperature, grad_filter, backend,
        ids_name)
    return logp, ent


def linear_inputs(hidden, weight, bias):
    """The tensors the linear-head kernels take: contiguous hidden [N, D], weight, bias."""
    return hidden.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous()


def selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    grad_filter: float | str | None = None,
):
    """Log-probability of `targets` under softmax((hidden @ weight.T + bias) / temperature).

    Never materializes the [..., V] logits. Differentiable w.r.t. hidden, weight and bias, through
    both outputs. Under torch.no_grad() it is the cheap scoring path for old/reference policies.

    Args:
        hidden: [..., D] float16/bfloat16/float32 hidden states.
        weight: [V, D] output-embedding (lm_head) weight, same dtype and device as hidden.
        targets: [...] integer token ids in [0, V).
        bias: optional [V] lm_head bias.
        temperature: logits are divided by it before the softmax.
        return_entropy: also return the entropy of the full distribution (nats).
        grad_filter: None (default) for the exact backward. "auto" or an eps >= 0 turns on
            gradient filtering in the Triton backward: a [tokens × vocabulary] tile whose
            d logits are all <= eps × its token's gradient scale is skipped (approximate;
            "auto" = finfo(dtype).eps / 32, 2^-12 for bfloat16). Other backends stay exact.

    Returns:
        logp [...] float32, and entropy [...] float32 if return_entropy.
    """
    check_linear_head(hidden, weight, bias)
    temperature = check_temperature(temperature)
    lead = hidden.shape[:-1]
    ids = check_token_ids("targets", targets, weight.shape[0], lead, hidden.device,
                          check_values=False)  # the op checks the range (torch.compile)
    eps = check_grad_filter(grad_filter, hidden.dtype)
    logp, ent = linear_logprobs_2d(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, ids.reshape(-1), temperature,
        backend_for(hidden), eps,
    )
    logp = logp.reshape(lead)
    return (logp, ent.reshape(lead)) if return_entropy else logp
