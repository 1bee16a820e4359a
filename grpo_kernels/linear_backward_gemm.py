"""Alternative backward of the linear-head log-prob: d logits per token chunk, then two GEMMs.

The default backward (`linear_logprobs.linear_logprob_backward`) adds every tile's products into
float32 buffers with atomics: (BLOCK_N + BLOCK_V)·D reductions per tile. This variant trades
them for memory traffic: a Triton kernel recomputes each logit tile and writes d logits for a
chunk of tokens ([chunk, V] in the inputs' dtype, never [N, V]); the library GEMMs then form
    d hidden[chunk] = d logits @ weight        d weight += d logits^T @ hidden[chunk]
Select it with GRPO_KERNELS_LINEAR_BACKWARD=gemm (benchmarks/NOTES.md says why both exist).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tile_configs
from .linear_logprobs import dz_tile, grouped_program, logit_tile
from .precision import dot_precision

# Bytes of the [chunk, V] d-logits buffer (bf16: 256 MiB holds 883 tokens of a 152k vocabulary).
DZ_BUFFER_BYTES = 256 * 2**20


@triton.jit(do_not_specialize=["n0", "n_count", "n_blocks", "v_blocks"])
def _linear_dz_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, dz_ptr,
    n0, n_count, V, D, stride_hn, stride_wv, stride_dz, inv_temp, n_blocks, v_blocks,
    HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # grouped order as in the atomic backward: GROUP_N token blocks sweep the vocabulary together
    pid_n, pid_v = grouped_program(tl.program_id(0), n_blocks, v_blocks, GROUP_N)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # row of the chunk
    n_mask = local < n_count
    offs_n = n0 + local  # token
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    g = tl.load(glogp_ptr + offs_n, mask=n_mask, other=0.0)
    busy = tl.max(tl.abs(g), axis=0)
    gh = g
    if HAS_GENT:
        gh = tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0)
        busy += tl.max(tl.abs(gh), axis=0)
    dz = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    if busy != 0.0:  # masked tokens: zeros without the recompute
        z = logit_tile(h_ptr, w_ptr, b_ptr, offs_n.to(tl.int64) * stride_hn,
                       offs_v.to(tl.int64) * stride_wv, offs_v, n_mask, v_mask, D, inv_temp,
                       HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PREC)
        dz = dz_tile(z, offs_n, offs_v, n_mask, v_mask, g, gh, tgt_ptr, lse_ptr, ent_ptr,
                     inv_temp, HAS_GENT)
    tl.store(dz_ptr + local.to(tl.int64)[:, None] * stride_dz + offs_v[None, :],
             dz.to(dz_ptr.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])


def linear_logprob_backward_gemm(
    hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature,
    needs=(True, True, True), buffer_bytes: int = DZ_BUFFER_BYTES, grad_filter=None,
):
    """Same contract as `linear_logprobs.linear_logprob_backward`, always exact: the GEMMs are
    dense, so gradient filtering (`grad_filter`) would change numbers without saving work."""
    N, D = hidden.shape
    V = weight.shape[0]
    cfg = tile_configs.linear_dz(hidden.dtype, hidden.device)
    BN = cfg["BLOCK_N"]
    chunk = max(BN, buffer_bytes // (V * hidden.element_size()) // BN * BN)
    chunk = min(chunk, triton.cdiv(max(N, 1), BN) * BN)
    dz = torch.empty((chunk, V), device=hidden.device, dtype=hidden.dtype)
    need_db = bias is not None and needs[2]
    dh = torch.zeros_like(hidden) if needs[0] else None
    dw = None
    db = torch.zeros(V, device=hidden.device, dtype=torch.float32) if need_db else None
    v_blocks = triton.cdiv(V, cfg["BLOCK_V"])
    for n0 in range(0, N, chunk):
        nc = min(chunk, N - n0)
        n_blocks = triton.cdiv(nc, BN)
        _linear_dz_kernel[(n_blocks * v_blocks,)](
            hidden, weight, bias if bias is not None else hidden, targets, lse, ent, g_logp,
            g_ent if g_ent is not None else g_logp, dz,
            n0, nc, V, D, hidden.stride(0), weight.stride(0), dz.stride(0), 1.0 / temperature,
            n_blocks, v_blocks, HAS_BIAS=bias is not None, HAS_GENT=g_ent is not None,
            DOT_PREC=dot_precision(hidden.dtype), **cfg,
        )
        d = dz[:nc]
        if needs[0]:
            torch.mm(d, weight, out=dh[n0:n0 + nc])
        if needs[1]:
            part = d.T @ hidden[n0:n0 + nc]  # [V, D], float32 accumulation inside the GEMM
            if dw is None:
                dw = part if N <= chunk else part.float()
            else:
                dw.add_(part)
        if need_db:
            db += d.float().sum(0)
    if needs[1]:
        dw = torch.zeros_like(weight) if dw is None else dw.to(weight.dtype)
    return dh, dw, None if db is None else db.to(bias.dtype)
