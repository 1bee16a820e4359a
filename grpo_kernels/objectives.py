"""Each objective's formulas in PyTorch: its per-token loss ℓ and its clip metrics, one section
per `loss_specs.Objective`, registered in `OBJECTIVE_MATH` under that object.

`grpo_math.per_token_loss` and `grpo_math.clip_indicators` look the objective up here and know
no objective by name: an objective without an entry is an error, never a silent default. The
derivative dℓ/dlogp is autograd's (the Triton epilogue, `kernels/epilogue.py`, writes it out by
hand for the per-token objectives and is cross-tested against these formulas).

Shapes: `TokenView` holds per-token [B, T] tensors (packed: [N]) with per-sequence values
already expanded to their tokens, except `advantages`, `mask` and the rollout ratio `isr`, as
given ([B, 1] or [B, T]), for the objectives that work per sequence. The formulas are the ones
of docs/semantics.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import loss_specs as ls
from .grpo_options import compute_vespo_phi
from .params import GRPOParams
from .traced_floats import exp, traced


class TokenView(NamedTuple):
    """What an objective's ℓ reads."""

    logp: torch.Tensor  # [B, T], differentiable
    old: torch.Tensor  # [B, T] the old policy's log-probs (logp detached when on-policy)
    w: torch.Tensor  # [B, T] the importance ratio (per sequence for GSPO, expanded)
    A: torch.Tensor  # [B, T] the advantages, expanded
    advantages: torch.Tensor  # as given: [B, 1] or [B, T]
    mask: torch.Tensor  # [B, T]
    isr: torch.Tensor | None  # the rollout importance ratio as given, or None
    params: GRPOParams
    layout: object  # a token layout (token_layouts.py): where tokens sit, per-sequence sums
    vespo_phi: torch.Tensor | None  # the sequence weight φ [B, 1] when already computed


class ObjectiveMath(NamedTuple):
    # ℓ [B, T] (or [B, 1] per sequence), differentiable w.r.t. view.logp, before the rollout
    # ratio (unless the objective's `rollout_ratio_inside`) and the KL
    loss: Callable[[TokenView], torch.Tensor]
    # (ratio, A, params, old_logps) -> its clip flags as float 0/1 tensors, in the order of
    # `Objective.clip_flags`; None for an objective without clip metrics
    flags: Callable | None = None


def clamp(x: torch.Tensor, low=None, high=None) -> torch.Tensor:
    """torch.clamp(x, low, high) by hyperparameters. Under torch.compile the bounds go in as 0-d
    tensors of x's dtype (`traced_floats.traced`): torch.clamp by a Python number fixes a
    symbolic float (a hyperparameter that changes between calls of a compiled step) to its
    value, a recompile per value."""
    return torch.clamp(x, traced(low, x), traced(high, x))


def capped_ratio(ratio: torch.Tensor, params: GRPOParams) -> torch.Tensor:
    """The ratio of the unclipped term: capped at `delta` (two-sided clipping) when set; dppo's
    truncated ratio coefficient."""
    return ratio if params.delta is None else clamp(ratio, high=params.delta)


def _low_high_region(low: torch.Tensor, high: torch.Tensor) -> tuple:
    return low.float(), high.float(), (low | high).float()


# ---- clipped: PPO's surrogate, ℓ = -min(min(w, δ)·A, clamp(w, 1-ε_lo, 1+ε_hi)·A) ------------


def _clipped_loss(v: TokenView) -> torch.Tensor:
    clipped = clamp(v.w, *v.params.clip_range)
    return -torch.minimum(capped_ratio(v.w, v.params) * v.A, clipped * v.A)


def _clipped_flags(ratio, A, params, old_logps) -> tuple:
    # the ratio of the unclipped term, i.e. after the delta cap
    w = capped_ratio(ratio, params)
    lo, hi = params.clip_range
    return _low_high_region((w < lo) & (A < 0), (w > hi) & (A > 0))


# ---- cispo: ℓ = -min(w, ε_hi)·A·logp, the cap detached -----------------------------------------


def _cispo_loss(v: TokenView) -> torch.Tensor:
    return -clamp(v.w, high=v.params.epsilon_high).detach() * v.A * v.logp


def _cispo_flags(ratio, A, params, old_logps) -> tuple:
    return (((ratio > params.epsilon_high) & (A > 0)).float(),)  # the raw ratio


# ---- sapo: a soft gate, ℓ = -(4/t)·σ(t·(w - 1))·A, t by the advantage's sign ------------------


def _sapo_loss(v: TokenView) -> torch.Tensor:
    p = v.params
    t = torch.where(v.A > 0, torch.full_like(v.A, p.sapo_temperature_pos),
                    torch.full_like(v.A, p.sapo_temperature_neg))
    return -(torch.sigmoid(t * (v.w - 1)) * 4 / t) * v.A


# ---- dppo: ℓ = -k·A·logp, k = min(w, δ)·[inside the total-variation trust region], detached ----


def dppo_trust_region(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                      params: GRPOParams) -> torch.Tensor:
    """dppo's binary total-variation mask, float 0/1 (detached): a token stays in the trust
    region while its probability p = e^logp has risen by at most epsilon_high over the old
    policy's (A > 0) or fallen by at most epsilon_low (A <= 0). logp, old [B, T] (or [N]),
    advantages broadcastable to them."""
    with torch.no_grad():
        change = torch.exp(logp) - torch.exp(old)
        inside = torch.where(advantages > 0, change <= params.epsilon_high,
                             change >= -params.epsilon_low)
        return inside.to(logp.dtype)


def _dppo_loss(v: TokenView) -> torch.Tensor:
    coef = capped_ratio(v.w, v.params) * dppo_trust_region(v.logp, v.old, v.A, v.params)
    return -coef.detach() * v.A * v.logp


def _dppo_flags(ratio, A, params, old_logps) -> tuple:
    # outside the trust region: p - p_old = p_old·(w - 1)
    old = torch.zeros_like(ratio) if old_logps is None else old_logps
    change = torch.exp(old) * (ratio - 1)
    return _low_high_region((change < -params.epsilon_low) & (A < 0),
                            (change > params.epsilon_high) & (A > 0))


# ---- vespo: ℓ = -φ·A·logp, φ a detached weight of the whole sequence ---------------------------


def _vespo_loss(v: TokenView) -> torch.Tensor:
    # φ comes from the token log-ratios whatever the level; the rollout ratio goes into φ
    phi = v.vespo_phi
    if phi is None:
        phi = compute_vespo_phi(v.logp - v.old, v.mask, v.advantages, v.isr, v.params, v.layout)
    return -v.layout.expand(phi) * v.A * v.logp


# ---- gmpo: one loss per sequence, the geometric mean of the clipped token ratios ---------------


def gmpo_sequence_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       importance_sampling_ratio: torch.Tensor | None, params: GRPOParams,
                       layout) -> torch.Tensor:
    """gmpo's loss per sequence, [B, 1] (packed [S, 1]): -Â·exp(mean_t m_t), the geometric mean
    of the token ratios after a pessimistic clip in log space,
        m_t = sgn(A_t)·min(sgn(A_t)·r_t, sgn(A_t)·clamp(r_t, -epsilon_low, epsilon_high)),
    r_t the token log-ratio [B, T]; Â the masked mean advantage of the sequence. A rollout
    ratio [B, T] enters as its geometric mean over the sequence, [B, 1] as it is."""
    A = layout.expand(advantages)
    sign = torch.sign(A)
    clipped = clamp(log_ratio, -params.epsilon_low, params.epsilon_high)
    m = sign * torch.minimum(sign * log_ratio, sign * clipped)
    count = layout.seq_sum(mask).clamp(min=1.0)  # [B, 1]
    ratio = torch.exp(layout.seq_sum(m * mask) / count)
    seq_adv = layout.seq_sum(A * mask) / count
    loss = -seq_adv * ratio
    if importance_sampling_ratio is not None:
        isr = importance_sampling_ratio
        if not layout.per_sequence(isr):
            isr = torch.exp(layout.seq_sum(torch.log(isr) * mask) / count)
        loss = loss * isr
    return loss


def _gmpo_loss(v: TokenView) -> torch.Tensor:
    return v.layout.expand(gmpo_sequence_loss(v.logp - v.old, v.advantages, v.mask, v.isr,
                                              v.params, v.layout))


def _gmpo_flags(ratio, A, params, old_logps) -> tuple:
    # the tokens its pessimistic clip takes the clipped log-ratio at: a trust region in log space
    lo, hi = exp(-params.epsilon_low, ratio), exp(params.epsilon_high, ratio)
    return _low_high_region((ratio < lo) & (A < 0), (ratio > hi) & (A > 0))


OBJECTIVE_MATH: dict[ls.Objective, ObjectiveMath] = {
    ls.CLIPPED: ObjectiveMath(_clipped_loss, _clipped_flags),
    ls.CISPO: ObjectiveMath(_cispo_loss, _cispo_flags),
    ls.SAPO: ObjectiveMath(_sapo_loss),
    ls.DPPO: ObjectiveMath(_dppo_loss, _dppo_flags),
    ls.VESPO: ObjectiveMath(_vespo_loss),
    ls.GMPO: ObjectiveMath(_gmpo_loss, _gmpo_flags),
}


def math_of(objective: ls.Objective) -> ObjectiveMath:
    """The formulas of `objective`; a ValueError for one this module does not know, or whose
    clip metrics the registry names but no formula computes."""
    found = OBJECTIVE_MATH.get(objective)
    if found is None:
        raise ValueError(f"objective {objective!r} has no formula in grpo_kernels.objectives")
    if bool(objective.clip_flags) != (found.flags is not None):
        raise ValueError(f"objective {objective!r}: its clip metrics {objective.clip_flags} and "
                         "its clip-flag formula disagree")
    return found
