"""The whole vocabulary's per-token statistics from every shard's, and the collectives that move
them.

Each rank's launchers give, over its own shard's logits z_v (z = cap(s·y) / τ as everywhere):

    lse_r = ln Σ_{v in shard r} e^{z_v}
    H_r   = lse_r - Σ_{v in r} p_rv·z_v,   p_rv = e^{z_v - lse_r}   (the shard's own entropy)
    zt_r  = z_target where the target falls in shard r, else 0       (logp_r + lse_r there)

One all-gather of [3, n] float32 per rank gives every rank all of them, and then, identically on
every rank (float64 for these [n] values):

    lse  = logsumexp_r lse_r
    w_r  = e^{lse_r - lse}                       (shard r's share of the softmax; Σ_r w_r = 1)
    H    = Σ_r w_r·(H_r - ln w_r)                (= lse - Σ_r w_r·(lse_r - H_r); every term >= 0)
    logp = Σ_r zt_r - lse

Every rank reads the same gathered tensor and runs the same operations on it, so the results,
and everything computed from them (the GRPO terms, the loss, the metrics), are bitwise equal on
every rank. The backward then needs only lse and H: the d-logits of shard r are
p_v·(...) with p_v = e^{z_v - lse} on its own columns, plus the target's one-hot term on the one
rank that holds the target (`shard_targets`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .shard import VocabShard, all_gather

F32, F64 = torch.float32, torch.float64


def shard_targets(ids: torch.Tensor, shard: VocabShard):
    """(forward ids, backward ids, inside) [n] each, for global ids [n] int64: the id within this
    rank's rows where it falls in them; elsewhere 0 for the forward (any valid column: its
    log-prob is not used) and -1 for the backward, where an id outside the shard adds no one-hot
    term (the launchers' contract for shard targets)."""
    local = ids - shard.start
    inside = (local >= 0) & (local < shard.sizes[shard.rank])
    return local.where(inside, 0), local.where(inside, -1), inside


def combine(shard: VocabShard, lse_r: torch.Tensor, ent_r: torch.Tensor, logp_r: torch.Tensor,
            inside: torch.Tensor):
    """(logp, entropy, lse) [n] float32 of the whole vocabulary from this shard's (lse_r, H_r,
    the log-prob of its forward ids logp_r) [n] float32 and `inside` [n] (the target is in this
    shard); one all-gather over the shard's group."""
    zt = torch.where(inside, logp_r.to(F64) + lse_r.to(F64), 0.0).to(F32)
    mine = torch.stack([lse_r.to(F32), ent_r.to(F32), zt])  # [3, n]
    every = gather(shard, mine).to(F64)  # [world, 3, n]
    lse_all, ent_all, zt_all = every.unbind(1)  # [world, n] each
    lse = torch.logsumexp(lse_all, dim=0)  # [n]
    log_w = lse_all - lse  # [world, n], <= 0
    ent = (log_w.exp() * (ent_all - log_w)).sum(dim=0)
    logp = zt_all.sum(dim=0) - lse
    return logp.to(F32), ent.to(F32), lse.to(F32)


def gather(shard: VocabShard, x: torch.Tensor) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, in rank order (one all-gather over the group)."""
    x = x.contiguous()
    out = x.new_empty((shard.world * x.shape[0], *x.shape[1:]))
    all_gather(out, x, shard.group)
    return out.view(shard.world, *x.shape)


def all_reduce_(shard: VocabShard, x: torch.Tensor | None) -> torch.Tensor | None:
    """x summed over the group's ranks, in place (the d hidden partial sums)."""
    if x is not None and shard.world > 1:
        dist.all_reduce(x, group=shard.group)
    return x
