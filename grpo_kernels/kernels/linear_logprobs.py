"""Triton kernels: selective log-prob (and entropy) of a linear head with temperature.

    y = hidden @ weight.T + bias             [N, V] raw logits, never materialized
    z = cap(s·y) / τ                         the model's logits (see below), then temperature
    lse = logsumexp(z), logp = z[target] - lse, H = lse - Σ softmax(z)·z

The logit transform (`logit_transform.py`) is what some models apply inside their forward: a
logit scale s (Cohere, z = s·y) and final-logit soft-capping (Gemma 2, cap(v) = c·tanh(v / c));
the scale comes first, then the cap, then the temperature (TRL divides the model's logits by τ).
Without either (HAS_SCALE = HAS_SOFTCAP = False, the default) the kernels are the plain ones.

Forward streams vocabulary tiles through an online log-sum-exp; an optional GRPO epilogue turns
logp into the per-token loss and its gradient coefficient in the same kernel. The jitted tile
helpers here (`logit_tile`, `grouped_program`, `loop_bound`) are shared with the two backwards,
which recompute each logit tile from hidden and weight and turn it into d logits (`dlogits.py`):
`linear_backward_gemm.py` (the default) and `linear_backward_atomic.py`.

Layout: tile helpers, forward kernel, split-combine kernel, launcher. The custom operators and
autograd formulas that call these launchers live in `grpo_kernels/ops/`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tile_configs
from .epilogue import EPILOGUE, EpilogueArgs, grpo_token_outputs, no_epilogue
from .logit_transform import (
    logit_transform_args,
    softcap_logits,
)
from .precision import dot_precision, head_dot
from .tile_configs import INTERPRET

# finite "-inf" for running maxima, so (m_old - m_new)·s stays 0·finite (constexpr: jit globals)
NEG_BIG = tl.constexpr(-1.0e38)
_INTERPRETED = tl.constexpr(INTERPRET)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def loop_bound(x):
    """A runtime `range()` bound: `x` itself when compiled (the branch is resolved at trace time,
    so the GPU code is the same); a Python int in Triton's interpreter, which holds scalars as
    one-element arrays that Triton 3.4-3.6 turn into range() bounds with int(array), refused by
    NumPy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars")."""
    if _INTERPRETED:
        return int(x.handle.data.item())
    return x


@triton.jit
def _store_token_results(
    offs_n, n_mask, lse, ent, logp, lse_ptr, ent_ptr, logp_ptr,
    epi_tensors, epi_scalars, EPI_FLAGS: tl.constexpr,
):
    """Stores a block's lse, entropy and logp [BLOCK_N], then runs the GRPO epilogue (the
    bundle of `epilogue.py`) on logp when there is one. Returns its weight·dℓ/dlogp [BLOCK_N]
    (zeros without an epilogue; callers that do not need it let the compiler drop it)."""
    logp = tl.where(n_mask, logp, 0.0)  # rows past N stay finite in the epilogue
    tl.store(lse_ptr + offs_n, lse, mask=n_mask)
    tl.store(ent_ptr + offs_n, ent, mask=n_mask)
    tl.store(logp_ptr + offs_n, logp, mask=n_mask)
    coef = tl.zeros_like(logp)
    if EPILOGUE & EPI_FLAGS:
        coef = grpo_token_outputs(offs_n, n_mask, logp, epi_tensors, epi_scalars, EPI_FLAGS)
    return coef


# Sizes that vary with the batch are not specialized on: one compile serves every sequence length.
@triton.jit
def logit_tile(
    h_ptr, w_ptr, b_ptr, rows_h, rows_w, offs_v, n_mask, v_mask, D, inv_temp,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """z = (hidden[rows_h] @ weight[rows_w]^T + bias) / τ: one [BLOCK_N, BLOCK_V] float32 tile,
    accumulated over D in BLOCK_D steps (the loop the compiler pipelines with cp.async).
    A float32 weight with 16-bit hidden (mixed head precision) takes `split_dot`."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for d0 in range(0, loop_bound(D), BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        h = tl.load(h_ptr + rows_h[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rows_w[:, None] + offs_d[None, :],
                    mask=v_mask[:, None] & d_mask[None, :], other=0.0)
        acc = head_dot(h, tl.trans(w), acc, DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit
def grouped_program(pid, n_blocks, n_cols, GROUP_N: tl.constexpr):
    """Program id -> (token block, column) in grouped order: programs that run at the same time
    cover GROUP_N token blocks × all n_cols columns (vocabulary splits or tiles), so hidden
    blocks and weight tiles are reused from L2 as in a grouped GEMM."""
    per_group = GROUP_N * n_cols
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(n_blocks - first_n, GROUP_N)
    return first_n + (pid % per_group) % group_size, (pid % per_group) // group_size


# The forward works in base-2 units, z2 = z·log2(e), so that each element's exponential is one
# exp2 (the hardware's ex2) with no extra multiply, and 1/τ is folded into the same FMA; lse and
# entropy are turned back into nats once per token (LOG2E, LN2 above).


@triton.jit
def _online_softmax_tile(y, scale2, m, s, t, v_mask, MASK_V: tl.constexpr):
    """Folds one [BLOCK_N, BLOCK_V] tile of unscaled logits y = hidden @ weight^T + bias into the
    running per-token m = max z2, s = Σ 2^(z2 - m), t = Σ 2^(z2 - m)·(z2 - m) of the base-2
    logits z2 = y·scale2 (scale2 = log2(e) / τ > 0).
    Full tiles: max z2 = scale2·max y exactly (rounding is monotonic), and z2 - m is one FMA.
    MASK_V (only the last tile, which reaches past V): columns past V get NEG_BIG, so that
    2^(NEG_BIG - m) = 0 and 0·(NEG_BIG - m) stays 0 (with -inf it would be NaN)."""
    if MASK_V:
        z2 = tl.where(v_mask[None, :], y * scale2, NEG_BIG)
        m_new = tl.maximum(m, tl.max(z2, axis=1))
        zc = z2 - m_new[:, None]
    else:
        m_new = tl.maximum(m, tl.max(y, axis=1) * scale2)
        zc = y * scale2 - m_new[:, None]
    p = tl.exp2(zc)
    alpha = tl.exp2(m - m_new)
    # re-centre the running sums on the new max: Σ 2^(z2-m_new)(z2-m_new) over the old tiles
    # = alpha·(t + (m - m_new)·s), plus this tile's terms
    t = alpha * (t + (m - m_new) * s) + tl.sum(p * zc, axis=1)
    s = alpha * s + tl.sum(p, axis=1)
    return m_new, s, t


@triton.jit
def _target_logit(h_ptr, w_ptr, b_ptr, tgt, rows_h, n_mask, D, stride_wv, inv_temp,
                  logit_mul, softcap,
                  HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """z[n, target_n] = cap(s·(hidden[n] · weight[target_n] + bias[target_n])) / τ  [BLOCK_N]
    float32 (cap(s·y) = y without a transform),
    once per token instead of a compare and select on every logit of every tile. Products and
    sums are float32 (the tile's dot sums in another order: the two agree to float32 rounding,
    and with TF32 tiles this value is the more accurate one)."""
    rows_t = tgt.to(tl.int64) * stride_wv
    acc = tl.zeros([BLOCK_N], tl.float32)
    for d0 in range(0, loop_bound(D), BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = n_mask[:, None] & (offs_d < D)[None, :]
        h = tl.load(h_ptr + rows_h[:, None] + offs_d[None, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + rows_t[:, None] + offs_d[None, :], mask=mask, other=0.0)
        acc += tl.sum(h.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + tgt, mask=n_mask, other=0.0).to(tl.float32)
    return softcap_logits(acc, logit_mul, softcap, HAS_SCALE, HAS_SOFTCAP) * inv_temp


@triton.jit(do_not_specialize=["N", "n_blocks", "n_splits", "tiles_per_split"])
def _linear_logprob_fwd_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr,
    part_ptr,  # [3, S, N] float32, base 2: running max m, Σ 2^(z2-m), Σ 2^(z2-m)(z2-m)
    lse_ptr, ent_ptr, logp_ptr,  # [N] float32 (split: split 0 leaves the target logit in logp)
    epi_tensors, epi_scalars,  # the GRPO epilogue's bundle (epilogue.py), read with EPI_FLAGS
    N, V, D, stride_hn, stride_wv, inv_temp, n_blocks, n_splits, tiles_per_split,
    logit_mul, softcap,  # the logit transform (`softcap_logits`), read only with its flag on
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EPI_FLAGS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # Programs that run at the same time cover GROUP_N token blocks × all vocabulary splits:
    # each step reads GROUP_N hidden blocks and n_splits weight tiles from DRAM for
    # GROUP_N·n_splits logit tiles (as a grouped GEMM does); the rest is served from L2. Without
    # splits, every running program would re-read its own [BLOCK_N, D] hidden block per tile.
    pid_n, pid_s = grouped_program(tl.program_id(0), n_blocks, n_splits, GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows_h = offs_n.to(tl.int64) * stride_hn
    # base-2 logits z2 = y·scale2 (logit_tile gets τ = 1: y unscaled). With a logit transform,
    # y is the transformed (model) logit cap(s·y) before the temperature: scale2 > 0 stays, so
    # the online softmax below is the same (a negative s is inside the transform, not in scale2)
    scale2 = inv_temp * LOG2E

    m = tl.full([BLOCK_N], NEG_BIG, tl.float32)  # running max of z2
    s = tl.zeros([BLOCK_N], tl.float32)  # Σ 2^(z2 - m)
    t = tl.zeros([BLOCK_N], tl.float32)  # Σ 2^(z2 - m)·(z2 - m)
    n_tiles = tl.cdiv(V, BLOCK_V)
    tile_lo = pid_s * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)
    full_hi = tl.minimum(tile_hi, V // BLOCK_V)  # tiles lying entirely inside V
    every_v = tl.full([BLOCK_V], 1, tl.int1)  # full tiles: loads need no vocabulary mask
    for tile in range(loop_bound(tile_lo), loop_bound(full_hi)):
        offs_v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        y = logit_tile(h_ptr, w_ptr, b_ptr, rows_h, offs_v.to(tl.int64) * stride_wv, offs_v,
                       n_mask, every_v, D, 1.0, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D,
                       DOT_PREC)  # [BLOCK_N, BLOCK_V]
        y = softcap_logits(y, logit_mul, softcap, HAS_SCALE, HAS_SOFTCAP)
        m, s, t = _online_softmax_tile(y, scale2, m, s, t, every_v, False)
    # the last, partial tile (0 or 1)
    for tile in range(loop_bound(tl.maximum(full_hi, tile_lo)), loop_bound(tile_hi)):
        offs_v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        y = logit_tile(h_ptr, w_ptr, b_ptr, rows_h, offs_v.to(tl.int64) * stride_wv, offs_v,
                       n_mask, v_mask, D, 1.0, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PREC)
        # columns past V: y = 0 (masked loads), so cap(s·0) = 0; the mask below drops them
        y = softcap_logits(y, logit_mul, softcap, HAS_SCALE, HAS_SOFTCAP)
        m, s, t = _online_softmax_tile(y, scale2, m, s, t, v_mask, True)

    if SPLIT:
        base = pid_s * N + offs_n
        plane = n_splits * N
        tl.store(part_ptr + base, m, mask=n_mask)
        tl.store(part_ptr + plane + base, s, mask=n_mask)
        tl.store(part_ptr + 2 * plane + base, t, mask=n_mask)
        if pid_s == 0:  # one split per token block computes the target logit
            tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=0)
            z_tgt = _target_logit(h_ptr, w_ptr, b_ptr, tgt, rows_h, n_mask, D, stride_wv,
                                  inv_temp, logit_mul, softcap, HAS_BIAS, BLOCK_N, BLOCK_D,
                                  HAS_SCALE, HAS_SOFTCAP)
            tl.store(logp_ptr + offs_n, z_tgt, mask=n_mask)  # the combine kernel reads it
    else:
        tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=0)
        z_tgt = _target_logit(h_ptr, w_ptr, b_ptr, tgt, rows_h, n_mask, D, stride_wv, inv_temp,
                              logit_mul, softcap, HAS_BIAS, BLOCK_N, BLOCK_D, HAS_SCALE,
                              HAS_SOFTCAP)
        log2_s = tl.log2(s)
        lse = (m + log2_s) * LN2
        _store_token_results(offs_n, n_mask, lse, (log2_s - t / s) * LN2, z_tgt - lse,
                             lse_ptr, ent_ptr, logp_ptr, epi_tensors, epi_scalars, EPI_FLAGS)


# S is not specialized either: with BLOCK_S from the vocabulary (tile_configs.combine), one
# compiled combine serves every N.
@triton.jit(do_not_specialize=["N", "S"])
def _combine_splits_kernel(
    part_ptr, lse_ptr, ent_ptr, logp_ptr, epi_tensors, epi_scalars, N, S,
    EPI_FLAGS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Merge S vocabulary-split partials [3, S, N] (base 2) into lse, entropy and logp (the
    # target logit waits in logp), then the epilogue.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_s = tl.arange(0, BLOCK_S)
    msk = n_mask[:, None] & (offs_s[None, :] < S)
    idx = offs_s[None, :] * N + offs_n[:, None]
    plane = S * N
    m_i = tl.load(part_ptr + idx, mask=msk, other=NEG_BIG)
    s_i = tl.load(part_ptr + plane + idx, mask=msk, other=0.0)
    t_i = tl.load(part_ptr + 2 * plane + idx, mask=msk, other=0.0)
    z_tgt = tl.load(logp_ptr + offs_n, mask=n_mask, other=0.0)
    m = tl.max(m_i, axis=1)
    scale = tl.exp2(m_i - m[:, None])
    s = tl.sum(s_i * scale, axis=1)
    t = tl.sum(scale * (t_i + (m_i - m[:, None]) * s_i), axis=1)
    s = tl.where(n_mask, s, 1.0)  # rows past N have no partials: keep log and t / s finite
    log2_s = tl.log2(s)
    lse = (m + log2_s) * LN2
    _store_token_results(offs_n, n_mask, lse, (log2_s - t / s) * LN2, z_tgt - lse,
                         lse_ptr, ent_ptr, logp_ptr, epi_tensors, epi_scalars, EPI_FLAGS)


def linear_logprob_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    epilogue: EpilogueArgs | None = None,
    splits: int | None = None,
    config: dict | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N] int64 (all contiguous).

    Returns float32 [N] tensors (logp, entropy, lse); with `epilogue` (the bundle that
    `epilogue.epilogue_args` builds) it also fills the epilogue's output tensors in place.
    softcap (c > 0) / logit_scale (s != 0): the logits are c·tanh(s·y / c) / τ (see the module
    docstring); None leaves that step out.
    """
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    f32 = dict(device=dev, dtype=torch.float32)
    logp = torch.empty(N, **f32)
    ent = torch.empty(N, **f32)
    lse = torch.empty(N, **f32)
    if N == 0:
        return logp, ent, lse
    cfg = dict(config or tile_configs.linear_fwd(N, V, D, hidden.dtype, dev))
    n_blocks = triton.cdiv(N, cfg["BLOCK_N"])
    n_tiles = triton.cdiv(V, cfg["BLOCK_V"])
    S = splits or tile_configs.num_splits(n_blocks, n_tiles, cfg["GROUP_N"], dev)
    tiles_per_split = triton.cdiv(n_tiles, S)
    S = triton.cdiv(n_tiles, tiles_per_split)  # no empty split
    part = torch.empty((3, S, N), **f32) if S > 1 else logp
    ep = epilogue or no_epilogue(logp)
    _linear_logprob_fwd_kernel[(n_blocks * S,)](
        hidden, weight, bias if bias is not None else hidden, targets,
        part, lse, ent, logp, ep.tensors, ep.scalars,
        N, V, D, hidden.stride(0), weight.stride(0), 1.0 / temperature, n_blocks, S,
        tiles_per_split,
        HAS_BIAS=bias is not None, SPLIT=S > 1, DOT_PREC=dot_precision(hidden.dtype),
        EPI_FLAGS=ep.flags, **cfg, **logit_transform_args(softcap, logit_scale),
    )
    if S > 1:
        ccfg = tile_configs.combine(max(S, tile_configs.split_cap(n_tiles)), dev)
        _combine_splits_kernel[(triton.cdiv(N, ccfg["BLOCK_N"]),)](
            part, lse, ent, logp, ep.tensors, ep.scalars, N, S, EPI_FLAGS=ep.flags, **ccfg,
        )
    return logp, ent, lse

