"""Library GEMMs with float32 accumulation for the three-pass head (`linear_loss_grad.py`).

`product(out, a, b)` is out = a @ b (+ bias) or out += a @ b, accumulated in float32 and rounded
once to out's dtype. a [M, K] and b [K, N] share one dtype (the head's GEMM dtype: bf16 / fp16,
or float32 for float32 and mixed heads); out is float32, that dtype, or (for float32 operands)
a 16-bit dtype. How it runs:

  CUDA, 16-bit operands, float32 out:  cuBLAS with a float32 output,
      torch.mm / torch.addmm(..., out_dtype=torch.float32, out=out)
  CUDA, out += a @ b (float32 out):    torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
      where this PyTorch accepts a float32 `self` for 16-bit operands (`addmm_f32_supported`,
      probed once per device without a sync), else `accumulate_mm` (a Triton kernel)
  CUDA, float32 operands:              plain float32 torch.mm / addmm. These follow PyTorch's
      float32 matmul setting (torch.backends.cuda.matmul.allow_tf32 /
      torch.set_float32_matmul_precision): nothing here overrides it
  CPU (Triton's interpreter):          torch.mm has no out_dtype on the CPU (NotImplementedError
      in torch 2.13), so the operands are upcast to float32 in slices of SLICE rows along the
      longest dimension (the vocabulary): never a float32 copy of a whole 16-bit weight

Nothing here reads a tensor's value on the host (no synchronization).
"""

from __future__ import annotations

import functools

import torch

from .accumulate_mm import accumulate_mm

F32 = torch.float32
SLICE = 4096  # rows of the vocabulary dimension upcast at once on the CPU


def product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            bias: torch.Tensor | None = None, add: bool = False) -> None:
    """out [M, N] = a [M, K] @ b [K, N] (+ bias [N]), or out += a @ b with `add` (out float32,
    no bias); float32 accumulation, one rounding to out's dtype (see the module docstring)."""
    if a.dtype != b.dtype or (bias is not None and bias.dtype != a.dtype):
        raise TypeError(f"gemm.product: a ({a.dtype}), b ({b.dtype}) and bias must share a dtype")
    if add and (out.dtype != F32 or bias is not None):
        raise ValueError("gemm.product: add=True needs a float32 out and no bias")
    if out.device.type != "cuda":
        _emulated(out, a, b, bias, add)
    elif add:
        _accumulate(out, a, b)
    elif out.dtype == a.dtype or out.dtype == F32:
        kw = {} if out.dtype == a.dtype else {"out_dtype": F32}  # 16-bit in, float32 out
        if bias is None:
            torch.mm(a, b, out=out, **kw)
        else:
            torch.addmm(bias, a, b, out=out, **kw)
    else:  # float32 operands, a 16-bit result (the mixed head's d hidden): rounded once
        out.copy_(torch.mm(a, b) if bias is None else torch.addmm(bias, a, b))


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b on CUDA, acc float32."""
    if a.dtype == F32:
        acc.addmm_(a, b)
    elif addmm_f32_supported(acc.device):
        torch.addmm(acc, a, b, out_dtype=F32, out=acc)
    else:
        accumulate_mm(acc, a, b)


@functools.cache
def addmm_f32_supported(device: torch.device) -> bool:
    """Whether torch.addmm takes a float32 `self` (the accumulator) with 16-bit operands and
    out_dtype=torch.float32 on this device: the schema aten::addmm.dtype_out exists in older
    releases too, whose CUDA kernel wanted `self` in the operands' dtype. Probed once per
    device with a 1 x 1 product (an argument check raises on the host before any launch; the
    result is never read, so nothing waits for the GPU)."""
    if device.type != "cuda" or "dtype_out" not in _overloads("addmm"):
        return False
    acc = torch.zeros(1, 1, device=device, dtype=F32)
    one = torch.ones(1, 1, device=device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, one, one, out_dtype=F32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _overloads(name: str) -> list:
    return list(getattr(torch.ops.aten, name).overloads())


def _emulated(out, a, b, bias, add: bool) -> None:
    """`product` on CPU tensors: float32 products of float32 (upcast) slices of SLICE rows along
    the longest of M, K, N, so a 16-bit operand is never upcast whole."""
    M, K = a.shape
    N = b.shape[1]
    if K > max(M, N):  # the sum runs over the vocabulary: float32 partial sums, then one store
        acc = torch.zeros(M, N, dtype=F32)
        for k0 in range(0, K, SLICE):
            acc.addmm_(a[:, k0:k0 + SLICE].to(F32), b[k0:k0 + SLICE].to(F32))
        _store(out, acc, bias, add)
    elif M >= N:
        b32 = b.to(F32)
        for m0 in range(0, M, SLICE):
            _store(out[m0:m0 + SLICE], a[m0:m0 + SLICE].to(F32) @ b32, bias, add)
    else:
        a32 = a.to(F32)
        for n0 in range(0, N, SLICE):
            _store(out[:, n0:n0 + SLICE], a32 @ b[:, n0:n0 + SLICE].to(F32),
                   None if bias is None else bias[n0:n0 + SLICE], add)


def _store(out, prod, bias, add: bool) -> None:
    """out (+)= prod (+ bias), prod float32: one rounding to out's dtype."""
    if bias is not None:
        prod += bias.to(F32)
    if add:
        out += prod
    else:
        out.copy_(prod)
