"""The logit transform on the chunked PyTorch path: a logit scale s and a soft cap c applied to the
raw logits y (hidden @ weight.T + bias, or the logits given) before the temperature τ:

    z = c·tanh(s·y / c)   (s = 1 without a scale),   or   z = s·y   (a scale only)
    log p = log_softmax(z / τ)

Same contract as the launchers in `linear_launchers.py` and `logits_launchers.py`, which hand
their calls here when a transform is on (see `tiles.head_transform` for the linear head's
scale-only case, which needs none of this).
Backward, by the chain rule through the transform (u = tanh(s·y / c)):

    d loss / dy = (d loss / d(z/τ)) · (1/τ) · dz/dy,   dz/dy = s·(1 - u²) = s·(1 - (z/c)²)
    d loss / d(z/τ) = g·(onehot - p) - g_H·p·(log p + H)

then d hidden = dy @ W, d weight = dy^T @ hidden, d bias = Σ dy, as without a transform. Tiles
are in nats here (the cap's tanh needs them unscaled): a plain, unfused tile loop, for models
that need the transform on a CPU.
"""

from __future__ import annotations

import torch

from .blocks import (
    active_rows,
    block_rows,
    pick_rows,
    row_blocks,
    row_parts,
    tile_shape,
    zero_rows_without_gradient,
)
from .tiles import (
    LOG2E,
    add_target_term,
    compute_dtype,
    empty_stats,
    exp_sums,
    finish_stats,
    in_tile,
    target_column,
)


def _transformed(x, dtype, softcap, logit_scale, temperature, unit=1.0):
    """(z/τ·unit of raw logits x as a fresh tensor in `dtype`, u = tanh(s·x/c) or None without a
    cap): z = c·u with a cap, s·x without; u is kept for the backward's dz/dx = s·(1 - u²)."""
    s = 1.0 if logit_scale is None else float(logit_scale)
    y = x.to(dtype)
    if softcap is None:
        return y * (s * unit / temperature), None
    u = torch.tanh(y * (s / softcap))
    return u * (softcap * unit / temperature), u


def linear_backward(hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature,
                    softcap, logit_scale, needs=(True, True, True), chunk_elements=None,
                    logp=None):
    """`linear_launchers.linear_logprob_backward` with a soft cap (a scale alone never comes here).
    logp: None or the forward's log-probs [N], from which the target column's x is taken
    (`tiles.target_column`: 1 - p of a dominant target, not through the lse)."""
    want_dh, want_dw = bool(needs[0]), bool(needs[1])
    want_db = bias is not None and bool(needs[2])
    idx = active_rows(g_logp, g_ent)
    V, D = weight.shape
    if (hidden.shape[0] == 0 or (idx is not None and idx.numel() == 0) or V == 0
            or not (want_dh or want_dw or want_db)):
        return tuple(torch.zeros_like(x) if want else None
                     for x, want in ((hidden, want_dh), (weight, want_dw), (bias, want_db)))
    dtype = compute_dtype(hidden, weight, bias)
    s = 1.0 if logit_scale is None else float(logit_scale)
    with torch.no_grad():
        h = pick_rows(hidden, idx, dtype)  # [Na, D], the tokens with a gradient
        g = pick_rows(g_logp, idx, dtype)[:, None]
        gh = None if g_ent is None else pick_rows(g_ent, idx, dtype)[:, None]
        ent_a = None if g_ent is None else pick_rows(ent, idx, dtype)[:, None]
        lse_a, tg = pick_rows(lse, idx, dtype)[:, None], pick_rows(targets, idx, dtype)
        target_x = target_column(pick_rows(logp, idx, dtype), g[:, 0],
                                 None if gh is None else gh[:, 0],
                                 None if gh is None else ent_a[:, 0])  # [Na] or None
        b = None if bias is None else bias.to(dtype)
        Na = h.shape[0]
        rows, cols = tile_shape(Na, V, chunk_elements, buffers=3)
        dh = torch.zeros((Na, D), dtype=dtype, device=h.device) if want_dh else None
        dw = torch.empty_like(weight) if want_dw else None
        db = torch.zeros(V, dtype=dtype, device=h.device) if want_db else None
        for v0 in range(0, V, cols):
            w = weight[v0:v0 + cols].to(dtype)  # [c, D]
            c = w.shape[0]
            bt = None if b is None else b[v0:v0 + c]
            col, inside = in_tile(tg, v0, c)
            dw_t = torch.zeros((c, D), dtype=dtype, device=h.device) if want_dw else None
            for _, _, part in row_parts(Na, rows):
                y = part(h) @ w.T if bt is None else torch.addmm(bt, part(h), w.T)  # [r, c]
                zt, u = _transformed(y, dtype, softcap, logit_scale, temperature)  # z/τ
                log_p = zt.sub_(part(lse_a))  # log p = z/τ - lse
                p = torch.exp(log_p)
                # x = -d loss/d(z/τ) = p·(g + g_H·(log p + H)) - g·onehot
                x = p.mul_(part(g)) if gh is None else log_p.add_(part(ent_a)).mul_(
                    part(gh)).add_(part(g)).mul_(p)
                add_target_term(x, part(col), part(inside), -part(g)[:, 0],
                                None if target_x is None else part(target_x))
                x.mul_(u.square_().neg_().add_(1.0))  # · (1 - u²): -dy·τ/s
                alpha = -s / temperature  # dy = alpha·x
                if want_dh:
                    part(dh).addmm_(x, w, alpha=alpha)
                if want_dw:
                    dw_t.addmm_(x.T, part(h), alpha=alpha)
                if want_db:
                    db[v0:v0 + c].add_(x.sum(0), alpha=alpha)
            if want_dw:
                dw[v0:v0 + c].copy_(dw_t)
        if want_dh:
            dh = dh.to(hidden.dtype) if idx is None else torch.zeros_like(hidden).index_copy_(
                0, idx, dh.to(hidden.dtype))
    return dh, dw, None if db is None else db.to(bias.dtype)


def logits_forward(logits, targets, temperature, softcap, logit_scale, chunk_elements=None):
    """`logits_launchers.logits_logprob_forward` with a transform: logits [B, T, V] are the raw
    y."""
    B, T, V = logits.shape
    out = empty_stats(B * T, logits.device)
    dtype = compute_dtype(logits)
    with torch.no_grad():
        for rows, tokens in row_blocks(B, T, block_rows(V, chunk_elements)):
            z, _ = _transformed(rows(logits), dtype, softcap, logit_scale, temperature, LOG2E)
            m = z.amax(dim=-1)  # [b, t], log2 units
            z.sub_(m[..., None])
            picked = z.gather(-1, tokens(targets).view(*z.shape[:2], 1)).view(-1)
            s, t = exp_sums(z, torch.empty_like(z))
            finish_stats(m.reshape(-1), s.view(-1), t.view(-1), picked, [tokens(o) for o in out])
    return out


def logits_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, softcap,
                    logit_scale, out=None, chunk_elements=None):
    """`logits_launchers.logits_logprob_backward` with a transform (d of the raw logits; `out`
    may be `logits` itself: a block is read whole before its gradient is written)."""
    B, T, V = logits.shape
    dx3 = torch.empty_like(logits) if out is None else out
    dtype = compute_dtype(logits)
    s = 1.0 if logit_scale is None else float(logit_scale)
    with torch.no_grad():
        for rows, tokens in row_blocks(B, T, block_rows(V, chunk_elements)):
            x, dx = rows(logits), rows(dx3)

            def per_token(v, shape=x.shape[:2]):
                return v.to(dtype).view(*shape, 1)

            g = per_token(tokens(g_logp))
            zt, u = _transformed(x, dtype, softcap, logit_scale, temperature)  # z/τ
            log_p = zt.sub_(per_token(tokens(lse)))
            p = torch.exp(log_p)
            if g_ent is None:
                nx = p.mul_(g)
            else:
                nx = log_p.add_(per_token(tokens(ent))).mul_(per_token(tokens(g_ent)))
                nx = nx.add_(g).mul_(p)
            ids = tokens(targets).view(*x.shape[:2], 1)
            nx.scatter_add_(-1, ids, -g)  # -d loss/d(z/τ)
            if u is not None:
                nx.mul_(u.square_().neg_().add_(1.0))  # dz/dy = s·(1 - u²)
            dx.copy_(nx.mul_(-s / temperature))
            zero_rows_without_gradient(dx, tokens(g_logp), None if g_ent is None else tokens(g_ent))
    return dx3

