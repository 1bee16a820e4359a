"""acc [M, D] float32 += A [M, K] @ B [K, D] with 16-bit A and B, without atomics.

The deterministic linear-head backward (`linear_backward_gemm.py`) sums one of its two products
over chunks of d logits. Library GEMMs with 16-bit operands round their result to 16 bits (a
float32 output from 16-bit inputs, `torch.mm(..., out_dtype=torch.float32)`, exists only as a
CUDA kernel, so it cannot run in the CPU tests), and a float32 partial per chunk followed by an
addition costs an extra pass over acc. Here every program owns one [BLOCK_M, BLOCK_D] tile of
acc: it loads the tile, adds its K-loop of tensor-core dots in float32 and stores it back. No
two programs touch the same element, and the K order is fixed, so the sum is bitwise
reproducible (no atomics).

A is read either row-major (element (m, k) at a + m·stride_a + k) or, with A_T, as the
transpose of a row-major [K, M] array (element (m, k) at a + k·stride_a + m), which is how the
backward reads d logits^T. B and acc are row-major with contiguous rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tile_configs
from .linear_logprobs import grouped_program, loop_bound
from .precision import dot_precision, tile_dot


@triton.jit(do_not_specialize=["M", "K", "m_blocks", "d_blocks"])
def _accumulate_mm_kernel(
    a_ptr, b_ptr, acc_ptr,  # A [M, K] (or [K, M] with A_T), B [K, D], acc [M, D] float32
    M, K, D, stride_a, stride_b, stride_acc, m_blocks, d_blocks,
    A_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # grouped order: programs running together share A row blocks and B column blocks in L2
    pid_m, pid_d = grouped_program(tl.program_id(0), m_blocks, d_blocks, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_mask = offs_m < M
    d_mask = offs_d < D
    out = acc_ptr + offs_m.to(tl.int64)[:, None] * stride_acc + offs_d[None, :]
    out_mask = m_mask[:, None] & d_mask[None, :]
    acc = tl.load(out, mask=out_mask, other=0.0)
    for k0 in range(0, loop_bound(K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if A_T:
            a_idx = offs_k.to(tl.int64)[None, :] * stride_a + offs_m[:, None]
        else:
            a_idx = offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        a = tl.load(a_ptr + a_idx, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + offs_k.to(tl.int64)[:, None] * stride_b + offs_d[None, :],
                    mask=k_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tile_dot(a, b, acc, DOT_PREC)
    tl.store(out, acc, mask=out_mask)


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  config: dict | None = None) -> None:
    """acc += a @ b in float32 for 16-bit a [M, K] and b [K, D] of one dtype.

    `a` may be a row-major array or the transpose (`.T`) of one; `b` and `acc` need contiguous
    rows. float32 operands go to `acc.addmm_` (a float32 GEMM already accumulates and rounds in
    float32, and follows PyTorch's TF32 setting).
    """
    M, K = a.shape
    D = b.shape[1]
    if acc.dtype != torch.float32 or acc.shape != (M, D) or b.shape[0] != K:
        raise ValueError(f"accumulate_mm: acc must be float32 [{M}, {D}], got {acc.dtype} "
                         f"{tuple(acc.shape)} for a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"accumulate_mm: a ({a.dtype}) and b ({b.dtype}) must share a dtype")
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if M == 0 or K == 0 or D == 0:
        return
    if a.stride(1) == 1:
        a_t, stride_a = False, a.stride(0)
    elif a.stride(0) == 1:
        a_t, stride_a = True, a.stride(1)
    else:
        raise ValueError(f"accumulate_mm: a must be row-major or a transpose, strides {a.stride()}")
    if b.stride(1) != 1 or acc.stride(1) != 1:
        raise ValueError("accumulate_mm: b and acc must have contiguous rows")
    cfg = dict(config or tile_configs.accumulate_mm(a.dtype, acc.device))
    m_blocks = triton.cdiv(M, cfg["BLOCK_M"])
    d_blocks = triton.cdiv(D, cfg["BLOCK_D"])
    _accumulate_mm_kernel[(m_blocks * d_blocks,)](
        a, b, acc, M, K, D, stride_a, b.stride(0), acc.stride(0), m_blocks, d_blocks,
        A_T=a_t, DOT_PREC=dot_precision(a.dtype), **cfg,
    )
