"""Float hyperparameters as tensors, so that torch.compile keeps them symbolic.

Under torch.compile, Dynamo traces a Python float that changes between calls of a compiled step
(a β, clip-range or temperature schedule) as a symbolic float. Whatever takes it as a Python
number fixes it to its value again (torch 2.13): a custom operator's `float` argument,
torch.tensor / torch.full, the bounds of torch.clamp, the values of torch.where, the q of
torch.nanquantile, and math.exp. The compiled step then builds a graph per value, and under
fullgraph=True fails at Dynamo's recompile limit. A product of a tensor and the symbolic float
keeps it a graph input, so the helpers here build 0-d tensors that way under compile. Eager code
gets what it got before, bit for bit: the Python number itself (`traced`, `exp`), or
`torch.full` of it (`scalar_tensor`).

Used by the custom operators' hyperparameter arguments (`ops/op_scalars.py`) and by the PyTorch
loss code traced around them (`objectives.clamp`, vespo's weights, gmpo's clip metrics; the
entropy quantile takes its written-out steps instead, `grpo_options.nanquantile`).
"""

from __future__ import annotations

import math

import torch


def scalar_tensor(value, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A 0-d tensor of `dtype` holding `value` (a Python number, or a traced symbolic float that
    stays symbolic), rounded once to `dtype` as torch.full rounds it."""
    if torch.compiler.is_compiling():
        # torch.full / torch.tensor of a symbolic float would fix it to its value; the product
        # rounds the float to dtype once and multiplies by 1 exactly
        return torch.ones((), dtype=dtype, device=device) * value
    return torch.full((), value, dtype=dtype, device=device)  # the cheapest eager construction


def traced(value, like: torch.Tensor, dtype: torch.dtype | None = None):
    """`value` (a number or None) as an operator's argument next to the tensor `like`: as it is in
    eager code; under torch.compile a 0-d tensor of `dtype` (default: like's) on like's device.
    Give the dtype that the operator would compute a Python number in, so that the result is
    the eager one (a 0-d tensor does not promote a tensor of the same kind)."""
    if value is None or not torch.compiler.is_compiling():
        return value
    return scalar_tensor(value, like.dtype if dtype is None else dtype, like.device)


def exp(value, like: torch.Tensor):
    """math.exp(value) in eager code; under torch.compile torch.exp of a 0-d float64 tensor on
    like's device (math.exp fixes a symbolic float to its value). A float32 tensor compared with
    either rounds it to float32 first."""
    if not torch.compiler.is_compiling():
        return math.exp(value)
    return torch.exp(scalar_tensor(value, torch.float64, like.device))
