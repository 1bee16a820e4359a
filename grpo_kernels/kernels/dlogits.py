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

import torch
import triton
import triton.language as tl

from .linear_logprobs import logit_tile
from .logit_transform import softcap_logits_grad
from .logits_logprobs import _expm1


def target_logp(logp: torch.Tensor | None, lse: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The backwards' (logp_ptr, HAS_LOGP) (`dz_tile`): the forward's log-probs [N] float32,
    or the lse in their place (never read) when they are not given."""
    return (lse, False) if logp is None else (logp.float().contiguous(), True)


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
def dz_tile(z, offs_n, offs_v, n_mask, v_mask, g, gh, tgt_ptr, lse_ptr, ent_ptr, logp_ptr,
            inv_temp, HAS_GENT: tl.constexpr, HAS_LOGP: tl.constexpr):
    """d logits of Σ g·logp + Σ g_H·H for one tile of z = logits / τ:
        dlogp/dz_j = onehot_j - p_j,  dH/dz_j = -p_j·(log p_j + H)
        d logits = [g·(onehot - p) - g_H·p·(log p + H)] / τ     (zero outside the masks)
    log p_j = z_j - lse, except at the target column with HAS_LOGP (the forward's logp [N] at
    logp_ptr): there log p = logp and 1 - p = -expm1(logp), free of the lse's rounding in nats
    (at a row dominated by its target, 1 - p is far below the lse's ulp). Without it (a
    vocabulary shard's backward) the target's p is read through the lse."""
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=-1)
    at_t = offs_v[None, :] == tgt[:, None]
    log_p = z - lse[:, None]
    if HAS_LOGP:
        logp = tl.load(logp_ptr + offs_n, mask=n_mask, other=0.0)
        if HAS_GENT:  # only the entropy term reads the target's log p and p
            log_p = tl.where(at_t, logp[:, None], log_p)
        p = tl.where(v_mask[None, :], tl.exp(log_p), 0.0)
        dz = g[:, None] * tl.where(at_t, -_expm1(logp)[:, None], -p)
    else:
        p = tl.where(v_mask[None, :], tl.exp(log_p), 0.0)
        dz = g[:, None] * (tl.where(at_t, 1.0, 0.0) - p)
    if HAS_GENT:
        ent = tl.load(ent_ptr + offs_n, mask=n_mask, other=0.0)
        dz -= gh[:, None] * p * (log_p + ent[:, None])
    return tl.where(n_mask[:, None] & v_mask[None, :], dz * inv_temp, 0.0)


@triton.jit
def transformed_dz(h_ptr, w_ptr, b_ptr, rows_h, rows_w, offs_n, offs_v, n_mask, v_mask, D,
                   g, gh, tgt_ptr, lse_ptr, ent_ptr, logp_ptr, inv_temp, logit_mul, softcap,
                   HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOGP: tl.constexpr):
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
                     ent_ptr, logp_ptr, inv_temp, HAS_GENT, HAS_LOGP) * dzdy
    else:
        z = logit_tile(h_ptr, w_ptr, b_ptr, rows_h, rows_w, offs_v, n_mask, v_mask, D, inv_temp,
                       HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PREC)
        dz = dz_tile(z, offs_n, offs_v, n_mask, v_mask, g, gh, tgt_ptr, lse_ptr, ent_ptr,
                     logp_ptr, inv_temp, HAS_GENT, HAS_LOGP)
    return dz
