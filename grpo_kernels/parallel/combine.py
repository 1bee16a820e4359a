"""The whole vocabulary's per-token statistics from every shard's, and the collectives that move
them.

Each rank's launchers give, over its own shard's logits z_v (z = cap(s·y) / τ as everywhere;
log2 units for c and s, nats for the rest):

    (c_r, s_r)  a reference and the sum against it, s_r = Σ_{v in shard r} 2^(z_v·log2(e) - c_r)
                (the chunked row launcher's max m and s; the Triton row forward's m and log s
                in nats, `split_reference`; the linear launchers' r = lse_r·log2(e) and their
                S, `chunked.tiles.reference_sums`; s_r = 1 where a launcher gives no S)
    H_r         the shard's own entropy, lse_r - Σ_{v in r} p_rv·z_v with p_rv = e^{z_v - lse_r}
    logp_r      z_target - lse_r where the target falls in shard r (its launcher's, which at a
                dominated row keeps float32's relative precision: ln2·(z_t - m) - ln s)

One all-gather of [4, n] float64 per rank (the launchers' values, sent exactly) gives every
rank all of them, and then, identically on every rank, in float64 (t: the target's shard,
from the global ids, which every rank holds):

    M      = max_r c_r
    S      = Σ_r s_r·2^(c_r - M)                    (= Σ_v 2^(z_v·log2(e) - M))
    ln w_r = ln s_r + ln2·(c_r - M) - ln S          (shard r's share of the softmax, in logs)
    lse    = ln2·M + ln S
    H      = Σ_r w_r·(H_r - ln w_r)                 (every term >= 0)
    logp   = logp_t + ln w_t                        (= z_t - lse)

logp is formed from the target shard's own logp and its share, not as z_t - lse: the float32
lse is rounded at its magnitude (2e-6 at |lse| ≈ 40), which would be most of the error of a
dominated row's logp ≈ -1e-6. Every rank reads the same gathered tensor and runs the same
operations on it, so the results, and everything computed from them (the GRPO terms, the loss,
the metrics), are bitwise equal on every rank.

The backward reads each column's p from (M, S) the way the launchers read it from their own
statistics, so that a dominant token's p (target or not) keeps float32's precision: the chunked
row launcher takes {"max": M, "sum": S} as its kept statistics (p = 2^(z - M) / S, and at the
dominant column z - M is the forward's own z - m_r, bit for bit), the Triton row backward the
split (ln2·M, ln S) in nats (`Stats.split`: p = e^((z - m) - ln S), ln2·M is the forward's m_r
exactly), the linear launchers the lse
and S' = S·2^(M - r) against r = lse·log2(e) as they form it (`lse_sum_at`); the target
column's p - 1 comes from logp, and its one-hot term only on the rank that holds the target
(`shard_targets`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..chunked.tiles import neg_lse_reference
from .shard import VocabShard, all_gather

F32, F64 = torch.float32, torch.float64
LN2, LOG2E = 0.6931471805599453, 1.4426950408889634


class Stats(NamedTuple):
    """The whole vocabulary's statistics [n] of a `combine`: logp, entropy, lse float32 (the
    outputs), and M (log2 units) and S = Σ_v 2^(z_v·log2(e) - M) float64, p's reference for a
    backward (M is one rank's c_r, exactly)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    ref: torch.Tensor
    sums: torch.Tensor

    def kept(self) -> dict:
        """The row launchers' kept statistics
        (`chunked.logits_launchers.logits_logprob_backward`): p = 2^(z - M) / S, float32 [n] each
        (M exactly; S rounded once)."""
        return {"max": self.ref.to(F32), "sum": self.sums.to(F32)}

    def split(self) -> tuple:
        """(m, ln S) [n] float32 each, the Triton row backward's `split` (nats): it reads
        p = e^((z - m) - ln S). M is c_r = m_r·log2(e) of the shard that holds the largest
        logit (`split_reference`), so m = ln2·M rounds back to that forward's float32 m_r
        exactly (the float64 products err by ~1e-16, far below float32's half ulp), and the
        dominant column's z - m is the forward's own, 0."""
        return (LN2 * self.ref).to(F32), torch.xlogy(1.0, self.sums).to(F32)

    def lse_sum_at(self, dtype) -> torch.Tensor:
        """S' = Σ_v 2^(z_v·log2(e) - r) = S·2^(M - r) [n] float32, r = lse·log2(e) formed as
        the linear launchers' backward forms it in its compute dtype (`neg_lse_reference`):
        their `lse_sum`, with which they read p = 2^(z - r) / S'. M - r is exact in float64."""
        neg_r = neg_lse_reference(self.lse.to(dtype)).to(F64)
        return (self.sums * torch.exp2(self.ref + neg_r)).to(F32)


STATS_ROWS = 4  # per-token values each rank gathers (c, s, logp, H): [world, 4, n] in all


def shard_targets(ids: torch.Tensor, shard: VocabShard):
    """(forward ids, backward ids, owner) [n] each, for global ids [n] int64: the id within this
    rank's rows where it falls in them; elsewhere 0 for the forward (any valid column: its
    log-prob is not used) and -1 for the backward, where an id outside the shard adds no one-hot
    term (the launchers' contract for shard targets); owner: the index of the shard that holds
    each id (the same on every rank)."""
    local = ids - shard.start
    inside = (local >= 0) & (local < shard.sizes[shard.rank])
    ends = torch.tensor(shard.sizes, device=ids.device).cumsum(0)  # [world]
    owner = torch.bucketize(ids, ends, right=True)  # ends[t - 1] <= id < ends[t]
    return local.where(inside, 0), local.where(inside, -1), owner


def lse_reference(lse_r: torch.Tensor, dtype) -> torch.Tensor:
    """c_r = lse_r·log2(e) [n] as the linear launchers form it in their compute dtype `dtype`
    (`chunked.tiles.reference_sums` forms their S against this value, bit for bit)."""
    return -neg_lse_reference(lse_r.to(dtype))


def split_reference(m: torch.Tensor, log_s: torch.Tensor) -> tuple:
    """(c_r, s_r) [n] float64 from the Triton row forward's terms of its lse in nats, m (the
    row max of z) and log s, s = Σ e^(z - m) (`logits_logprob_forward(split_out=...)`):
    c_r = m·log2(e), s_r = e^(log s), so that s_r = Σ 2^(z·log2(e) - c_r)."""
    return m.to(F64) * LOG2E, log_s.to(F64).exp()


def combine(shard: VocabShard, ref_r: torch.Tensor, sum_r: torch.Tensor, logp_r: torch.Tensor,
            ent_r: torch.Tensor, owner: torch.Tensor) -> Stats:
    """`Stats` of the whole vocabulary from this shard's (c_r, s_r, logp_r, H_r) [n] (module
    docstring; logp_r of its forward ids, read only where this shard is the target's `owner`
    [n] int64, `shard_targets`); one all-gather over the shard's group."""
    mine = torch.stack([ref_r.to(F64), sum_r.to(F64), logp_r.to(F64), ent_r.to(F64)])
    c, s, logp_all, ent_all = gather(shard, mine).unbind(1)  # [world, n] each
    M = c.amax(dim=0)  # [n]
    S = (s * torch.exp2(c - M)).sum(dim=0)  # [n], >= the largest shard's s >= 1 (or ≈ 1)
    log_S = torch.xlogy(1.0, S)  # ln S (torch.log forks threads for small tensors: MKL VML)
    log_w = torch.xlogy(1.0, s) + LN2 * (c - M) - log_S  # [world, n], <= 0
    ent = (log_w.exp() * (ent_all - log_w)).sum(dim=0)
    # the target's shard's terms (the others' logp_r is a dummy column's)
    logp = (logp_all + log_w).gather(0, owner[None]).squeeze(0)
    lse = LN2 * M + log_S
    return Stats(logp.to(F32), ent.to(F32), lse.to(F32), M, S)


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
