"""Chunked PyTorch path for CPUs without the Triton interpreter.

Same contract as the Triton launchers in `linear_logprobs.py`: selective log-prob and entropy of
a linear head, and their backward, over chunks of tokens so that at most [chunk, V] logits exist at
any time (never [N, V]). The trainer uses it on a laptop.
"""

from __future__ import annotations

import torch

# Elements of one [chunk, V] float32 temporary (a few of them are alive at once): 2^24 = 64 MiB.
CHUNK_ELEMENTS = 2**24


def _chunk_rows(V: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(V, 1))


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_t: float):
    z = h @ weight.T
    if bias is not None:
        z = z + bias
    return z.to(torch.promote_types(z.dtype, torch.float32)) * inv_t  # [C, V], >= float32


def linear_logprob_forward(hidden, weight, bias, targets, temperature, chunk_elements=None):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N]
    -> float32 (logp, entropy, lse), each [N]."""
    N = hidden.shape[0]
    V = weight.shape[0]
    C = _chunk_rows(V, chunk_elements or CHUNK_ELEMENTS)
    f32 = dict(device=hidden.device, dtype=torch.float32)
    logp, ent, lse = (torch.empty(N, **f32) for _ in range(3))
    inv_t = 1.0 / temperature
    with torch.no_grad():
        for i in range(0, N, C):
            z = _logits(hidden[i:i + C], weight, bias, inv_t)
            lse_c = torch.logsumexp(z, dim=-1)
            log_p = z - lse_c[:, None]
            ent[i:i + C] = -(log_p.exp() * log_p).sum(-1)
            logp[i:i + C] = log_p.gather(1, targets[i:i + C, None]).squeeze(1)
            lse[i:i + C] = lse_c
    return logp, ent, lse


def linear_logprob_backward(
    hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature, chunk_elements=None
):
    """Gradients of Σ g_logp·logp + Σ g_ent·H (see linear_logprobs.linear_logprob_backward)."""
    N = hidden.shape[0]
    V = weight.shape[0]
    C = _chunk_rows(V, chunk_elements or CHUNK_ELEMENTS)
    inv_t = 1.0 / temperature
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    dh = torch.empty_like(hidden)
    dw = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype)
    db = torch.zeros(V, device=weight.device, dtype=acc_dtype) if bias is not None else None
    with torch.no_grad():
        for i in range(0, N, C):
            h = hidden[i:i + C]
            g = g_logp[i:i + C, None]
            if not bool(g.any()) and (g_ent is None or not bool(g_ent[i:i + C].any())):
                dh[i:i + C] = 0  # masked tokens: no work
                continue
            log_p = _logits(h, weight, bias, inv_t) - lse[i:i + C, None]
            p = log_p.exp()
            # dz = g·(onehot - p) - g_H·p·(log p + H), then / τ
            dz = -g * p
            dz.scatter_add_(1, targets[i:i + C, None], g)
            if g_ent is not None:
                dz -= g_ent[i:i + C, None] * p * (log_p + ent[i:i + C, None])
            dz = (dz * inv_t).to(hidden.dtype)
            dh[i:i + C] = dz @ weight
            dw += (dz.T @ h).to(acc_dtype)
            if db is not None:
                db += dz.sum(0).to(acc_dtype)
    return dh, dw.to(weight.dtype), None if db is None else db.to(bias.dtype)
