"""The GEMM helper of the three-pass route (grpo_kernels/kernels/gemm.py): float32 accumulation
and one rounding to the output's dtype, against float64, on the CPU (operands upcast in slices)
and, on a GPU, through cuBLAS and the accumulate_mm fallback."""

import pytest
import torch
from helpers import max_err

from grpo_kernels.kernels import gemm


def _scale(t):
    return max(t.abs().max().item(), 1e-3) if t.numel() else 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mnk", [(7, 9, 40), (40, 9, 7), (7, 40, 9)],
                         ids=["N-longest", "M-longest", "K-longest"])
def test_gemm_product(dtype, mnk, device, monkeypatch):
    """gemm.product: float32 accumulation, one rounding to out's dtype, with a bias, adding into
    a float32 out, and a 16-bit out from float32 operands; sliced (SLICE = 8) on the CPU."""
    monkeypatch.setattr(gemm, "SLICE", 8)
    M, N, K = mnk
    g = torch.Generator().manual_seed(0)
    a, b, bias, acc = (torch.randn(*s, generator=g) for s in ((M, K), (K, N), (N,), (M, N)))
    a, b, bias = (x.to(dtype).to(device) for x in (a, b, bias))
    exact = a.double() @ b.double()
    for out_dtype in {dtype, torch.float32}:
        out = torch.empty(M, N, dtype=out_dtype, device=device)
        gemm.product(out, a, b, bias)
        want = (exact + bias.double()).to(out_dtype)
        assert max_err(out, want) <= 1e-5 * _scale(want.double()) + _ulp(want), out_dtype
    out = acc.to(device).clone()
    gemm.product(out, a, b, add=True)
    assert max_err(out, acc.double().to(device) + exact) <= 1e-5 * _scale(exact)
    if dtype == torch.float32:  # the mixed head's d hidden: float32 operands, a 16-bit result
        out = torch.empty(M, N, dtype=torch.bfloat16, device=device)
        gemm.product(out, a, b)
        assert max_err(out, exact.bfloat16()) <= _ulp(exact.bfloat16())


def _ulp(x):
    """One unit in the last place of x's largest magnitude, in x's dtype (0 for float32)."""
    return 0.0 if x.dtype == torch.float32 else (
        x.abs().max().double().item() * torch.finfo(x.dtype).eps)


@pytest.mark.gpu
def test_gemm_accumulation_without_addmm_dtype(monkeypatch, device):
    """The accumulate_mm fallback where torch.addmm takes no float32 self with 16-bit operands."""
    monkeypatch.setattr(gemm, "addmm_f32_supported", lambda device: False)
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(*s, generator=g).bfloat16().to(device) for s in ((300, 70), (70, 130)))
    acc = torch.randn(300, 130, device=device)
    want = acc.double() + a.double() @ b.double()
    gemm.product(acc, a, b, add=True)
    assert max_err(acc, want) <= 1e-5 * _scale(want)
