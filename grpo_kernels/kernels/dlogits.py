"""Triton helpers of the two linear-head backwards (`linear_backward_gemm.py`,
`linear_backward_atomic.py`): a token block's gradient inputs and one tile of d logits,
recomputed from hidden and weight (`linear_logprobs.logit_tile`), never stored by the forward.

For z = logits / τ, p = softmax(z), H = -Σ p·log p and the loss's gradients g = dL/dlogp,
g_H = dL/dH of each token:
    dlogp/dz_j = onehot_j - p_j,   dH/dz_j = -p_j·(log p_j + H)
    d logits  = [g·(onehot - p) - g_H·p·(log p + H)] / τ
and with a logit transform z = cap(s·y) of the raw logits y, d/dy = (d/dz)·dz/dy.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .linear_logprobs import logit_tile
from .logit_transform import softcap_logits_grad


@triton.jit
def token_gradients(glogp_ptr, gent_ptr, offs_n, n_mask, HAS_GENT: tl.constexpr):
    """The backwards' per-token inputs of one token block, each [BLOCK_N] float32: (g_logp,
    g_entropy (g_logp when there is none; then never read), the token's gradient scale
    |g_logp| + |g_entropy|, which gradient filtering and the skipping of all-zero blocks read)."""
    g = tl.load(glogp_ptr + offs_n, mask=n_mask, other=0.0)
    scale = tl.abs(g)
    gh = g
    if HAS_GENT:
        gh = tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0)
        scale += tl.abs(gh)
    return g, gh, scale


@triton.jit
def dz_tile(z, offs_n, offs_v, n_mask, v_mask, g, gh, tgt_ptr, lse_ptr, ent_ptr, inv_temp,
            HAS_GENT: tl.constexpr):
    """d logits of Σ g·logp + Σ g_H·H for one tile of z = logits / τ:
        dlogp/dz_j = onehot_j - p_j,  dH/dz_j = -p_j·(log p_j + H)
        d logits = [g·(onehot - p) - g_H·p·(log p + H)] / τ     (zero outside the masks)"""
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=-1)
    log_p = z - lse[:, None]
    p = tl.where(v_mask[None, :], tl.exp(log_p), 0.0)
    onehot = tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
    dz = g[:, None] * (onehot - p)
    if HAS_GENT:
        ent = tl.load(ent_ptr + offs_n, mask=n_mask, other=0.0)
        dz -= gh[:, None] * p * (log_p + ent[:, None])
    return tl.where(n_mask[:, None] & v_mask[None, :], dz * inv_temp, 0.0)


@triton.jit
def transformed_dz(h_ptr, w_ptr, b_ptr, rows_h, rows_w, offs_n, offs_v, n_mask, v_mask, D,
                   g, gh, tgt_ptr, lse_ptr, ent_ptr, inv_temp, logit_mul, softcap,
                   HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The backward's d loss / dy tile of the raw logits y = hidden @ weight.T + bias.
    Without a transform: the logit tile at 1/τ and `dz_tile`, as always. With one
    (z = cap(s·y), logits z / τ):
        d loss / dy = dz_tile(z / τ)·dz/dy,   dz_tile = [g·(onehot - p) - g_H·p·(log p + H)] / τ
        dz/dy = s·(1 - (z / c)²) with a cap, s without (`softcap_logits_grad`)."""
    if HAS_SCALE or HAS_SOFTCAP:
        y = logit_tile(h_ptr, w_ptr, b_ptr, rows_h, rows_w, offs_v, n_mask, v_mask, D, 1.0,
                       HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PREC)
        z, dzdy = softcap_logits_grad(y, logit_mul, softcap, HAS_SCALE, HAS_SOFTCAP)
        dz = dz_tile(z * inv_temp, offs_n, offs_v, n_mask, v_mask, g, gh, tgt_ptr, lse_ptr,
                     ent_ptr, inv_temp, HAS_GENT) * dzdy
    else:
        z = logit_tile(h_ptr, w_ptr, b_ptr, rows_h, rows_w, offs_v, n_mask, v_mask, D, inv_temp,
                       HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PREC)
        dz = dz_tile(z, offs_n, offs_v, n_mask, v_mask, g, gh, tgt_ptr, lse_ptr, ent_ptr,
                     inv_temp, HAS_GENT)
    return dz
