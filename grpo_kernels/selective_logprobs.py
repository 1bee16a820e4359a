"""Differentiable selective log-prob (and entropy) of a linear head, and backend dispatch.

Backends: "triton" (CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set before triton was
imported) and "torch" (the chunked PyTorch path in `chunked.py`). Both save only per-token
statistics (lse, entropy) for backward, never logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from . import chunked
from . import linear_logprobs as triton_impl
from .validation import check_linear_head, check_temperature, check_token_ids

BACKENDS = ("triton", "torch")
_IMPLS = {"triton": triton_impl, "torch": chunked}
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


class LinearLogprobFunction(torch.autograd.Function):
    """(hidden [N, D], weight [V, D], bias [V] | None, targets [N]) -> (logp [N], entropy [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, backend):
        impl = _IMPLS[backend]
        logp, ent, lse = impl.linear_logprob_forward(hidden, weight, bias, targets, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature = temperature
        ctx.backend = backend
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        dh, dw, db = _IMPLS[ctx.backend].linear_logprob_backward(
            hidden, weight, bias, targets, lse, ent, g_logp.float().contiguous(), g_ent,
            ctx.temperature,
        )
        return dh, dw, db, None, None, None


def linear_logprobs_2d(hidden, weight, bias, targets, temperature, backend):
    """Unchecked core: contiguous [N, D] hidden and int64 [N] targets -> (logp, entropy) [N]."""
    return LinearLogprobFunction.apply(
        hidden.contiguous(), weight.contiguous(),
        None if bias is None else bias.contiguous(), targets, temperature, backend,
    )


def selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
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

    Returns:
        logp [...] float32, and entropy [...] float32 if return_entropy.
    """
    check_linear_head(hidden, weight, bias)
    temperature = check_temperature(temperature)
    lead = hidden.shape[:-1]
    ids = check_token_ids("targets", targets, weight.shape[0], lead, hidden.device)
    logp, ent = linear_logprobs_2d(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, ids.reshape(-1), temperature,
        backend_for(hidden),
    )
    logp = logp.reshape(lead)
    return (logp, ent.reshape(lead)) if return_entropy else logp
