"""Chunked PyTorch path for CPUs without the Triton interpreter.

Same contract as the Triton launchers in `linear_logprobs.py` and `logits_logprobs.py`: selective
log-prob and entropy, and their backward, over chunks of tokens so that at most [chunk, V]
float32 temporaries exist at any time (never [N, V]). The trainer uses it on a laptop.
"""

from __future__ import annotations

import torch

# Elements of one [chunk, V] float32 temporary (a few of them are alive at once): 2^24 = 64 MiB.
CHUNK_ELEMENTS = 2**24


def _chunk_rows(V: int, chunk_elements: int | None) -> int:
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(V, 1))


def _upcast(z: torch.Tensor, inv_t: float) -> torch.Tensor:
    return z.to(torch.promote_types(z.dtype, torch.float32)) * inv_t  # [C, V], >= float32


def _stats(z: torch.Tensor, targets: torch.Tensor):
    """z [C, V] (already / τ) -> logp, entropy, lse: [C] each."""
    lse = torch.logsumexp(z, dim=-1)
    log_p = z - lse[:, None]
    ent = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(1, targets[:, None]).squeeze(1), ent, lse


def _dz(z, targets, lse, ent, g, gh, inv_t):
    """d z-input for Σ g·logp + Σ gh·H:  [g·(onehot - p) - gh·p·(log p + H)] / τ, [C, V]."""
    log_p = z - lse[:, None]
    p = log_p.exp()
    dz = -g[:, None] * p
    dz.scatter_add_(1, targets[:, None], g[:, None].to(dz.dtype))
    if gh is not None:
        dz -= gh[:, None] * p * (log_p + ent[:, None])
    return dz * inv_t


def _busy(g, gh) -> bool:
    return bool(g.any()) or (gh is not None and bool(gh.any()))


def _head_logits(h, weight, bias, inv_t):
    z = h @ weight.T
    return _upcast(z if bias is None else z + bias, inv_t)


def _empty_stats(N, device):
    return tuple(torch.empty(N, device=device, dtype=torch.float32) for _ in range(3))


def linear_logprob_forward(hidden, weight, bias, targets, temperature, chunk_elements=None):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N]
    -> float32 (logp, entropy, lse), each [N]."""
    C = _chunk_rows(weight.shape[0], chunk_elements)
    out = _empty_stats(hidden.shape[0], hidden.device)
    with torch.no_grad():
        for i in range(0, hidden.shape[0], C):
            z = _head_logits(hidden[i:i + C], weight, bias, 1.0 / temperature)
            for dst, src in zip(out, _stats(z, targets[i:i + C])):
                dst[i:i + C] = src
    return out


def linear_logprob_backward(
    hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature,
    needs=(True, True, True), chunk_elements=None, grad_filter=None,
):
    """Gradients of Σ g_logp·logp + Σ g_ent·H (see linear_logprobs.linear_logprob_backward).

    Always exact: gradient filtering (`grad_filter`) saves work only in the Triton atomic
    backward; here every chunk is one dense matmul either way."""
    C = _chunk_rows(weight.shape[0], chunk_elements)
    inv_t = 1.0 / temperature
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    dh = torch.zeros_like(hidden) if needs[0] else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype) if needs[1] else None
    db = torch.zeros(weight.shape[0], device=weight.device, dtype=acc_dtype)
    with torch.no_grad():
        for i in range(0, hidden.shape[0], C):
            g, gh = g_logp[i:i + C], None if g_ent is None else g_ent[i:i + C]
            if not _busy(g, gh):
                continue  # masked tokens: no work
            h = hidden[i:i + C]
            z = _head_logits(h, weight, bias, inv_t)
            dz = _dz(z, targets[i:i + C], lse[i:i + C], ent[i:i + C], g, gh, inv_t)
            dz = dz.to(hidden.dtype)
            if needs[0]:
                dh[i:i + C] = dz @ weight
            if needs[1]:
                dw += (dz.T @ h).to(acc_dtype)
            if bias is not None and needs[2]:
                db += dz.sum(0).to(acc_dtype)
    return (dh if needs[0] else None, dw.to(weight.dtype) if needs[1] else None,
            db.to(bias.dtype) if bias is not None and needs[2] else None)


def _row_blocks(B: int, T: int, C: int):
    """Split [B, T] rows into blocks of about C: whole sequences when C >= T, else pieces of one
    sequence. Yields (sequence slice, position slice, flat start); each block of a [B, T, V]
    view is then itself a view, so sliced logits are never copied whole."""
    if C >= T:
        step = C // T
        for b in range(0, B, step):
            yield slice(b, b + step), slice(0, T), b * T
    else:
        for b in range(B):
            for t in range(0, T, C):
                yield slice(b, b + 1), slice(t, t + C), b * T + t


def logits_logprob_forward(logits, targets, temperature, chunk_elements=None):
    """logits [B, T, V], targets [B·T] -> float32 (logp, entropy, lse), each [B·T]."""
    B, T, V = logits.shape
    out = _empty_stats(B * T, logits.device)
    with torch.no_grad():
        for bs, ts, i in _row_blocks(B, T, _chunk_rows(V, chunk_elements)):
            x = logits[bs, ts].reshape(-1, V)
            n = x.shape[0]
            for dst, src in zip(out, _stats(_upcast(x, 1.0 / temperature), targets[i:i + n])):
                dst[i:i + n] = src
    return out


def logits_logprob_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, out=None,
                            chunk_elements=None):
    """d logits [B, T, V] in logits' dtype, written into `out` (may be `logits` itself)."""
    B, T, V = logits.shape
    dx3 = torch.empty_like(logits) if out is None else out
    inv_t = 1.0 / temperature
    with torch.no_grad():
        for bs, ts, i in _row_blocks(B, T, _chunk_rows(V, chunk_elements)):
            x, dx = logits[bs, ts].reshape(-1, V), dx3[bs, ts]
            n = x.shape[0]
            g, gh = g_logp[i:i + n], None if g_ent is None else g_ent[i:i + n]
            if not _busy(g, gh):
                dx.zero_()
                continue
            dz = _dz(_upcast(x, inv_t), targets[i:i + n], lse[i:i + n], ent[i:i + n], g, gh,
                     inv_t)
            dx.copy_(dz.reshape(dx.shape))
    return dx3
