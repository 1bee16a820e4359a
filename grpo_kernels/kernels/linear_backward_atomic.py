"""Triton kernel: the atomic backward of the linear-head selective log-prob.

Gradients of Σ g_logp·logp + Σ g_ent·H w.r.t. hidden [N, D], weight [V, D] and bias [V], with
logp and H as in `linear_logprobs.py`. Every [BLOCK_N, BLOCK_V] program recomputes its logit
tile, turns it into d logits (`transformed_dz`: [g·(onehot − p) − g_H·p·(log p + H)] / τ, times
the logit transform's derivative), and adds its products into float32 accumulators with atomics:

    d hidden  += d logits @ weight         [BLOCK_N, D]
    d weight  += d logits^T @ hidden       [BLOCK_V, D]
    d bias    += Σ_n d logits              [BLOCK_V]

Atomics make the sums' order vary from run to run (not deterministic). With gradient filtering
(grad_filter = eps > 0) a tile whose d logits are all below eps × its tokens' gradient scale skips
its products: the one case where this backward can beat `linear_backward_gemm.py`, the default
(`ops.backends.linear_backward_mode` chooses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tile_configs
from .dlogits import token_gradients, transformed_dz
from .linear_logprobs import grouped_program, loop_bound
from .logit_transform import grad_filter_scale, logit_transform_args
from .precision import dot_precision, head_dot, split_dot, tile_dot


@triton.jit
def _add_tile_grads(
    dz, h_ptr, w_ptr, dh_ptr, dw_ptr, db_ptr, rows_h, rows_w, rows_dh, rows_dw, offs_v,
    n_mask, v_mask, D,
    COMPUTE_DH: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Adds one d-logits tile dz [BLOCK_N, BLOCK_V] into the float32 accumulators:
    dh[rows] += dz @ w,  dw[rows] += dz^T @ h  (over D in BLOCK_D slabs),  db += Σ_n dz.
    A float32 weight with 16-bit hidden (mixed): dz @ w splits w, dz^T @ h splits dz (float32,
    so d weight keeps ~16 bits more than a 16-bit dz would give it)."""
    if COMPUTE_DB:
        tl.atomic_add(db_ptr + offs_v, tl.sum(dz, axis=0), mask=v_mask, sem="relaxed")
    dzc = dz.to(h_ptr.dtype.element_ty)  # the dots take the inputs' dtype, accumulate in fp32
    for d0 in range(0, loop_bound(D), BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        if COMPUTE_DH:  # frozen inputs (e.g. a frozen lm_head) skip their half of the work
            w = tl.load(w_ptr + rows_w[:, None] + offs_d[None, :],
                        mask=v_mask[:, None] & d_mask[None, :], other=0.0)
            dh_part = head_dot(dzc, w, tl.zeros([dz.shape[0], BLOCK_D], tl.float32), DOT_PREC)
            tl.atomic_add(dh_ptr + rows_dh[:, None] + offs_d[None, :], dh_part,
                          mask=n_mask[:, None] & d_mask[None, :], sem="relaxed")
        if COMPUTE_DW:
            h = tl.load(h_ptr + rows_h[:, None] + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            dw_part = tl.zeros([dz.shape[1], BLOCK_D], tl.float32)
            if w_ptr.dtype.element_ty == h_ptr.dtype.element_ty:
                dw_part = tile_dot(tl.trans(dzc), h, dw_part, DOT_PREC)
            else:
                dw_part = split_dot(h, tl.trans(dz), dw_part, True)
            tl.atomic_add(dw_ptr + rows_dw[:, None] + offs_d[None, :], dw_part,
                          mask=v_mask[:, None] & d_mask[None, :], sem="relaxed")


@triton.jit(do_not_specialize=["N", "v_begin", "v_count", "n_blocks", "v_blocks", "filter_eps"])
def _linear_logprob_bwd_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr,
    dh_ptr, dw_ptr, db_ptr,  # float32 accumulators: dh [N, D], dw [v_count, D], db [V]
    N, V, D, v_begin, v_count, stride_hn, stride_wv, stride_dh, stride_dw, inv_temp,
    n_blocks, v_blocks, filter_eps, logit_mul, softcap,
    HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr, FILTER: tl.constexpr,
    COMPUTE_DH: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # d hidden = d logits @ weight, d weight = d logits^T @ hidden, d bias = Σ_n d logits, with
    # d logits from dz_tile; each [BLOCK_N, BLOCK_V] tile adds its products with atomics.
    # With a logit transform z = cap(s·y), "d logits" is d/dy = (d/dz)·dz/dy (transformed_dz)
    # grouped order: GROUP_N token blocks sweep the vocabulary together (weight tiles hit in L2)
    pid_n, pid_v = grouped_program(tl.program_id(0), n_blocks, v_blocks, GROUP_N)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    g, gh, scale = token_gradients(glogp_ptr, gent_ptr, offs_n, n_mask, HAS_GENT)
    # tokens without gradient (padding) read as absent, whatever their hidden state holds
    # (NaN·0 would be NaN); a NaN gradient still counts (NaN != 0)
    n_mask = n_mask & (scale != 0.0)
    # token blocks with no gradient (masked tokens) cost nothing (a sum, so NaN still flows)
    if tl.sum(scale, axis=0) != 0.0:
        offs_vl = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # row in this vocabulary chunk
        v_mask = offs_vl < v_count
        offs_v = v_begin + offs_vl
        rows_h = offs_n.to(tl.int64) * stride_hn
        rows_w = offs_v.to(tl.int64) * stride_wv
        rows_dh = offs_n.to(tl.int64) * stride_dh
        rows_dw = offs_vl.to(tl.int64) * stride_dw
        dz = transformed_dz(h_ptr, w_ptr, b_ptr, rows_h, rows_w, offs_n, offs_v, n_mask, v_mask,
                            D, g, gh, tgt_ptr, lse_ptr, ent_ptr, inv_temp, logit_mul, softcap,
                            HAS_BIAS, HAS_GENT, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PREC, HAS_SCALE,
                            HAS_SOFTCAP)
        if FILTER:
            # gradient filtering (opt-in, approximate): the tile's products are skipped when
            # every |d logit| in it is <= filter_eps × its token's scale / τ (the launcher
            # scales filter_eps by |s| with a logit scale). Only the
            # recompute above is paid for such tiles: 2 of the 6 N·V·D FLOPs, no atomics.
            thr = filter_eps * scale * inv_temp
            over = tl.where(tl.abs(dz) <= thr[:, None], 0, 1)  # NaN counts as over
            if tl.max(over) > 0:  # one flat reduction (linear_backward_gemm)
                _add_tile_grads(dz, h_ptr, w_ptr, dh_ptr, dw_ptr, db_ptr, rows_h, rows_w,
                                rows_dh, rows_dw, offs_v, n_mask, v_mask, D,
                                COMPUTE_DH, COMPUTE_DW, COMPUTE_DB, BLOCK_D, DOT_PREC)
        else:
            _add_tile_grads(dz, h_ptr, w_ptr, dh_ptr, dw_ptr, db_ptr, rows_h, rows_w, rows_dh,
                            rows_dw, offs_v, n_mask, v_mask, D,
                            COMPUTE_DH, COMPUTE_DW, COMPUTE_DB, BLOCK_D, DOT_PREC)


# float32 scratch for d weight when the weight is 16-bit: the vocabulary is processed in chunks
# whose scratch stays under this many bytes (the weight gradient itself is in the weight's dtype).
WEIGHT_SCRATCH_BYTES = 256 * 2**20


def linear_logprob_backward_atomic(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    temperature: float,
    needs: tuple = (True, True, True),
    config: dict | None = None,
    scratch_bytes: int = WEIGHT_SCRATCH_BYTES,
    grad_filter: float | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
):
    """Gradients of Σ g_logp·logp + Σ g_ent·H w.r.t. hidden [N, D], weight [V, D], bias [V].

    lse, ent, g_logp, g_ent: [N] float32; needs: which of (hidden, weight, bias) want a gradient.
    grad_filter: None (exact) or eps >= 0: skip the products of tiles whose d logits are all
    <= eps × (|g_logp| + |g_ent|) / τ of their token (gradient filtering; eps = 0 only skips
    all-zero tiles, which is exact).
    softcap, logit_scale: the logit transform of `linear_logprob_forward` (gradients through it).
    Returns (d hidden, d weight, d bias), None where not needed, in the inputs' dtypes;
    accumulation is float32 (atomics into float32 buffers).
    """
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    f32 = dict(device=dev, dtype=torch.float32)
    cfg = dict(config or tile_configs.linear_bwd_atomic(hidden.dtype, dev,
                                                        weight_dtype=weight.dtype))
    need_dh, need_dw, need_db = needs[0], needs[1], bias is not None and needs[2]
    dh32 = torch.zeros((N, D), **f32) if need_dh else lse
    db32 = torch.zeros(V, **f32) if need_db else lse
    direct = weight.dtype == torch.float32 or not need_dw
    dw = torch.zeros_like(weight) if weight.dtype == torch.float32 and need_dw else None
    BV = cfg["BLOCK_V"]
    if direct:
        v_chunk = V
    else:
        v_chunk = max(BV, scratch_bytes // (4 * D) // BV * BV)
        v_chunk = min(v_chunk, triton.cdiv(V, BV) * BV)
        scratch = torch.empty((v_chunk, D), **f32)
        dw = torch.empty_like(weight)
    n_blocks = triton.cdiv(N, cfg["BLOCK_N"]) if N else 0
    for v0 in range(0, V, v_chunk):
        vc = min(v_chunk, V - v0)
        acc = (lse if dw is None else dw[v0:v0 + vc]) if direct else scratch[:vc].zero_()
        v_blocks = triton.cdiv(vc, BV)
        if n_blocks:
            _linear_logprob_bwd_kernel[(n_blocks * v_blocks,)](
                hidden, weight, bias if bias is not None else hidden, targets, lse, ent,
                g_logp, g_ent if g_ent is not None else g_logp, dh32, acc, db32,
                N, V, D, v0, vc, hidden.stride(0), weight.stride(0), D, D,
                1.0 / temperature, n_blocks, v_blocks,
                0.0 if grad_filter is None else float(grad_filter) * grad_filter_scale(
                    logit_scale),
                HAS_BIAS=bias is not None, HAS_GENT=g_ent is not None,
                FILTER=grad_filter is not None,
                COMPUTE_DH=need_dh, COMPUTE_DW=need_dw, COMPUTE_DB=need_db,
                DOT_PREC=dot_precision(hidden.dtype), **cfg,
                **logit_transform_args(softcap, logit_scale),
            )
        if not direct:
            dw[v0:v0 + vc].copy_(acc)
    dh = None if not need_dh else dh32 if hidden.dtype == torch.float32 else dh32.to(hidden.dtype)
    db = db32.to(bias.dtype) if need_db else None
    return dh, dw, db
