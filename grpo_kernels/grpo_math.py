"""The GRPO per-token math and aggregation in PyTorch, on [B, T] tensors.

This is the one PyTorch implementation of the per-token loss, aggregation, entropy bonus and
metrics of docs/semantics.md; each objective's own formulas (ℓ and its clip flags) are in
`objectives.py`, looked up by the loss type's `Objective`. The reference
(`grpo_kernels.reference`) and the loss route (`loss_call.linear_call`: the chunked CPU path,
sequence-level ratios and the options that need whole sequences or the batch, from
`grpo_options`) call it on top of their own log-probs; the fused token-level Triton kernels
carry the same per-token loss in a Triton epilogue (`kernels/epilogue.py`), its one twin,
cross-tested against `objectives.py`, and leave aggregation, the entropy bonus and the metrics
to `finish_loss` here.

Shapes: B sequences, T completion positions. `logp`, `old_logps`, `ref_logps`, `mask` are [B, T];
`advantages` is [B, 1] or [B, T]; `importance_sampling_ratio` is [B, 1] or [B, T]. A packed batch
(`cu_seqlens`, see `token_layouts.py`) has per-token values [N] and per-sequence values [S, 1]; the
functions take its `layout` (default: the padded layout of `mask`) for the few steps that depend
on where tokens sit (per-sequence sums, expanding a per-sequence value to its tokens).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from . import loss_specs as ls
from .grpo_options import compute_vespo_phi, high_entropy_mask, off_policy_mask
from .objectives import TokenView, math_of
from .params import GRPOParams
from .token_layouts import PaddedLayout, layout_of
from .validation import LossInputs


def token_weights(
    mask: torch.Tensor,
    params: GRPOParams,
    num_items_in_batch: float | torch.Tensor | None = None,
    layout=None,
) -> torch.Tensor:
    """Per-token loss weights of the loss type: mask [B, T] float32 -> weight [B, T] float32
    (packed: mask [N] -> [N]).

    Every aggregation of docs/semantics.md is Σ_bt weight[b,t]·ℓ[b,t], which lets the kernels
    take the weights as an input and stay generic over loss types. Padded positions weigh 0.
    """
    layout = layout or PaddedLayout(mask)
    B = layout.num_seqs
    normalizer = params.spec.normalizer
    if normalizer is ls.Normalizer.SEQUENCE_MEAN:
        # mean over sequences of the per-sequence masked mean
        seq_len = layout.seq_sum(mask).clamp(min=1.0)
        return mask / (layout.expand(seq_len) * B)
    if normalizer is ls.Normalizer.BATCH_TOKENS:
        return mask / mask.sum().clamp(min=1.0)
    if normalizer is ls.Normalizer.FIXED_LENGTH:
        return mask / float(B * params.max_completion_length)
    if normalizer is ls.Normalizer.TOKEN_COUNT:
        if num_items_in_batch is None:
            norm = mask.sum()
        else:
            norm = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
        return mask / norm.clamp(min=1.0)
    if normalizer is ls.Normalizer.SEQUENCE_SUM:
        # mean over sequences of Σ_t mask·ℓ: a sequence weighs its length (TRL 1.16's luspo)
        return mask / float(max(B, 1))
    raise ValueError(f"unknown normalizer {normalizer!r} of loss_type {params.loss_type!r}")


def entropy_bonus_weights(mask: torch.Tensor, entropy_coef: float) -> torch.Tensor:
    """d(entropy bonus)/d entropy per token: -entropy_coef · mask / max(Σ mask, 1).

    The bonus is -entropy_coef × the masked mean entropy for every loss type (TRL 1.16), never
    divided by num_items_in_batch; written as Σ weight·entropy so that the fused kernels' loss
    op can return the weight as its entropy coefficient. mask [B, T] (or [N]) -> same shape."""
    return mask * (-entropy_coef / mask.sum().clamp(min=1.0))


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, entropy_coef: float) -> torch.Tensor:
    """The term added to the loss: -entropy_coef · Σ mask·entropy / max(Σ mask, 1); 0-dim,
    differentiable w.r.t. entropy. entropy, mask [B, T]."""
    return masked_values(entropy, entropy_bonus_weights(mask, entropy_coef)).sum()


def importance_log_weights(
    logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str, layout=None
) -> torch.Tensor:
    """log w: [B, T] for "token"; [B, 1] masked mean of the log-ratio for "sequence" (GSPO).
    (Packed: [N] and [S, 1].)"""
    log_ratio = logp - old
    if level == "token":
        return log_ratio
    layout = layout or PaddedLayout(mask)
    return layout.seq_sum(log_ratio * mask) / layout.seq_sum(mask).clamp(min=1.0)


def masked_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mask·x, with 0 wherever mask is 0 whatever x holds there (NaN or ±inf at a padded
    position: 0·NaN would be NaN). x broadcastable to mask [B, T] (packed [N])."""
    return torch.where(mask != 0, x * mask, 0.0)


def real_token_values(logp, old_logps, ref_logps, importance_sampling_ratio, mask, layout,
                      sampling_logps=None) -> tuple:
    """The per-token values the loss reads, with padding made inert: where mask is 0, logp
    reads 0, old, ref and sampling log-probs read that logp (ratio 1, kl 0, no drift) and a
    per-token rollout ratio reads 1. Padded positions then contribute exactly 0 to the loss and
    its gradients whatever they hold (NaN, ±inf), on every route: selecting before the
    arithmetic, not after it, so that no 0·inf reaches autograd. logp, old, ref, sampling
    [B, T] (packed [N]); the ratio [B, T] or [B, 1] ([N] or [S, 1]; a per-sequence ratio is
    left as given). Returns (logp, old, ref, ratio, sampling), None where given None."""
    real = mask != 0
    logp = torch.where(real, logp, 0.0)
    inert = logp.detach()

    def fill(x):
        return None if x is None else torch.where(real, x, inert)

    isr = importance_sampling_ratio
    if isr is not None and not layout.per_sequence(isr):
        isr = torch.where(real, isr, 1.0)
    return logp, fill(old_logps), fill(ref_logps), isr, fill(sampling_logps)


def per_token_loss(
    logp: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
    importance_sampling_ratio: torch.Tensor | None = None,
    layout=None,
    *,
    vespo_phi: torch.Tensor | None = None,
    token_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ℓ of docs/semantics.md, differentiable w.r.t. logp.

    vespo uses `vespo_phi` (its sequence weights, [B, 1]; computed here when None). token_scale
    ([B, T] or [B, 1], 0/1) multiplies the policy term before the rollout ratio and the KL: the
    off-policy and entropy masks of `policy_loss`.

    Returns (loss [B, T] or [B, 1], ratio w [B, T] or [B, 1] (detached), kl [B, T] or None);
    packed: (loss [N], ratio [N] or [S, 1], kl [N] or None).
    """
    layout = layout or PaddedLayout(mask)
    logp, old_logps, ref_logps, importance_sampling_ratio, _ = real_token_values(
        logp, old_logps, ref_logps, importance_sampling_ratio, mask, layout)
    old = logp.detach() if old_logps is None else old_logps
    ratio = torch.exp(importance_log_weights(logp, old, mask, params.importance_sampling_level,
                                             layout))
    objective = params.spec.objective
    # per-sequence values meet per-token ones: broadcasting when padded, expanded when packed
    view = TokenView(logp, old, layout.expand(ratio), layout.expand(advantages), advantages,
                     mask, importance_sampling_ratio, params, layout, vespo_phi)
    loss = math_of(objective).loss(view)
    if token_scale is not None:
        loss = loss * layout.expand(token_scale)
    if importance_sampling_ratio is not None and not objective.rollout_ratio_inside:
        # a per-sequence ratio of a sequence without real tokens is never read
        loss = loss * torch.where(mask != 0, layout.expand(importance_sampling_ratio), 1.0)
    kl = None
    if params.beta != 0.0:
        d = ref_logps - logp
        kl = torch.exp(d) - d - 1
        if params.use_bias_correction_kl:
            kl = kl * view.w
        loss = loss + params.beta * kl
    return loss, ratio.detach(), kl


def clip_flag_names(params: GRPOParams) -> tuple[str, ...]:
    """The clip flags logged for this loss type (keys of `clip_indicators`, in order)."""
    return params.spec.clip_flags


def metric_names(params: GRPOParams) -> tuple[str, ...]:
    """The keys of `grpo_metrics` for these hyperparameters, in order."""
    return (("entropy",) + (("kl",) if params.beta != 0.0 else ()) + clip_flag_names(params)
            + ((ls.SEQUENCE_WEIGHT_METRIC,) if params.spec.objective.sequence_weight else ()))


def clip_indicators(
    ratio: torch.Tensor, advantages: torch.Tensor, params: GRPOParams, layout=None,
    old_logps: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The clip flags TRL 1.16 logs, as float 0/1 tensors (detached).

    ratio [B, T] or [B, 1] (sequence level), advantages [B, 1] or [B, T]; each flag has their
    broadcast shape (packed: [S, 1] if both are per sequence, else [N]). Each objective's
    flags are its own formula (`objectives.py`); dppo's need `old_logps`.
    """
    with torch.no_grad():
        if layout is not None:
            ratio, advantages = layout.align(ratio, advantages)
        formulas = math_of(params.spec.objective)  # raises for an objective it does not know
        if formulas.flags is None:  # an objective without clip metrics (sapo, vespo)
            return {}
        flags = formulas.flags(ratio, advantages, params, old_logps)
        return dict(zip(clip_flag_names(params), flags, strict=True))


def metric_sums(
    entropy: torch.Tensor,
    ratio: torch.Tensor,
    kl: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
    layout=None,
    vespo_phi: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (sum, count), 0-dim float32 each; the metric is sum / max(count, 1).

    As TRL 1.16 logs them: a [B, T] quantity is summed over real tokens (count Σ mask); a quantity
    with one value per sequence ([B, 1]: the clip flags at importance_sampling_level="sequence")
    is summed over all B sequences, fully masked ones included (count B). Sums and counts, not
    means, so that a trainer can add them up across processes before dividing. Packed: [N]
    per token, [S, 1] per sequence (zero-length sequences included). vespo_phi: vespo's φ.
    """
    layout = layout or PaddedLayout(mask)
    with torch.no_grad():
        maskf = mask.float()

        def terms(x):
            x = x.float()
            if layout.per_sequence(x):  # one value per sequence: the plain mean over the B rows
                return x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            return masked_values(x, maskf).sum(), maskf.sum()

        sums = {"entropy": terms(entropy)}
        if kl is not None:
            sums["kl"] = terms(kl)
        for name, flag in clip_indicators(ratio, advantages, params, layout, old_logps).items():
            sums[name] = terms(flag)
        if vespo_phi is not None:
            sums[ls.SEQUENCE_WEIGHT_METRIC] = terms(vespo_phi)
    return sums


def grpo_metrics(*metric_sums_args, **kwargs) -> dict[str, torch.Tensor]:
    """The loss metrics of one process (detached 0-dim float32), from `metric_sums`' arguments:
    each metric's sum / max(count, 1), keys in `metric_names` order."""
    return {name: total / count.clamp(min=1.0)
            for name, (total, count) in metric_sums(*metric_sums_args, **kwargs).items()}


class PolicyTerms(NamedTuple):
    """What `policy_loss` returns (per-token [B, T] / per-sequence [B, 1]; packed [N] / [S, 1])."""

    loss: torch.Tensor  # Σ weight·ℓ, 0-dim, differentiable
    ratio: torch.Tensor  # importance ratio w, detached
    kl: torch.Tensor | None  # k3 KL per token (beta != 0)
    vespo_phi: torch.Tensor | None = None  # vespo's φ, detached
    entropy_mask: torch.Tensor | None = None  # top_entropy_quantile < 1: kept tokens, 0/1


def option_masks(logp, entropy, inputs: LossInputs, params: GRPOParams, layout,
                 entropy_gather=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(token_scale for `per_token_loss` or None, entropy mask or None): the product of the
    off-policy mask ([B, 1]) and the high-entropy mask ([B, T]) that are on."""
    scale, ent_mask = None, None
    if params.off_policy_mask_threshold is not None:
        # the sampler's log-probs if given, else the old policy's (else none: no drift)
        sampling = inputs.sampling_logps if inputs.sampling_logps is not None else (
            inputs.old_logps if inputs.old_logps is not None else logp.detach())
        scale = off_policy_mask(logp, sampling, inputs.advantages, inputs.mask,
                                params.off_policy_mask_threshold, layout)
    if params.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
        ent_mask = high_entropy_mask(entropy, inputs.mask, params.top_entropy_quantile,
                                     entropy_gather)
        scale = ent_mask if scale is None else layout.expand(scale) * ent_mask
    return scale, ent_mask


def policy_loss(logp: torch.Tensor, inputs: LossInputs, params: GRPOParams, layout=None, *,
                entropy: torch.Tensor | None = None, entropy_gather=None) -> PolicyTerms:
    """The aggregated policy loss Σ weight·ℓ without the entropy bonus, differentiable w.r.t.
    logp [B, T], with the ratio, KL, vespo's φ and the entropy mask (PolicyTerms). Packed
    inputs (inputs.cu_seqlens): logp [N], per-sequence values [S, 1]. `entropy` ([B, T]) is
    needed for top_entropy_quantile < 1; `entropy_gather`: see `high_entropy_mask`."""
    layout = layout or layout_of(inputs.mask, inputs.cu_seqlens)
    logp, old_logps, ref_logps, isr, sampling = real_token_values(
        logp, inputs.old_logps, inputs.ref_logps, inputs.importance_sampling_ratio, inputs.mask,
        layout, inputs.sampling_logps)
    inputs = dataclasses.replace(inputs, old_logps=old_logps, ref_logps=ref_logps,
                                 importance_sampling_ratio=isr, sampling_logps=sampling)
    old = logp.detach() if inputs.old_logps is None else inputs.old_logps
    phi = None
    if params.spec.objective.sequence_weight:
        phi = compute_vespo_phi(logp - old, inputs.mask, inputs.advantages,
                                inputs.importance_sampling_ratio, params, layout)
    token_scale, ent_mask = option_masks(logp, entropy, inputs, params, layout, entropy_gather)
    loss_tok, ratio, kl = per_token_loss(
        logp, inputs.old_logps, inputs.ref_logps, inputs.advantages, inputs.mask, params,
        inputs.importance_sampling_ratio, layout, vespo_phi=phi, token_scale=token_scale,
    )
    weights = token_weights(inputs.mask, params, inputs.num_items_in_batch, layout)
    return PolicyTerms((weights * loss_tok).sum(), ratio, kl, phi, ent_mask)


def finish_loss(policy: torch.Tensor, entropy: torch.Tensor, ratio: torch.Tensor,
                kl: torch.Tensor | None, inputs: LossInputs, params: GRPOParams, layout=None, *,
                vespo_phi: torch.Tensor | None = None,
                entropy_mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) from the policy loss Σ weight·ℓ (0-dim) and the per-token values of
    `policy_loss` (entropy [B, T] or [N], differentiable when entropy_coef != 0): adds the
    entropy bonus (over the entropy mask's tokens when there is one) and computes the metrics
    of one process."""
    layout = layout or layout_of(inputs.mask, inputs.cu_seqlens)
    loss = policy
    if params.entropy_coef != 0.0:
        bonus_mask = inputs.mask if entropy_mask is None else inputs.mask * entropy_mask
        loss = loss + entropy_bonus(entropy, bonus_mask, params.entropy_coef)
    return loss, grpo_metrics(entropy.detach(), ratio, kl, inputs.advantages, inputs.mask, params,
                              layout, vespo_phi=vespo_phi, old_logps=inputs.old_logps)


def grpo_loss_from_logps(logp: torch.Tensor, entropy: torch.Tensor, inputs: LossInputs,
                         params: GRPOParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss and metrics from per-token log-probs and entropies ([B, T] float32; [N] for a
    packed batch) and the validated inputs. Gradients flow into `logp` (and `entropy` when
    entropy_coef != 0)."""
    layout = layout_of(inputs.mask, inputs.cu_seqlens)
    terms = policy_loss(logp, inputs, params, layout, entropy=entropy)
    return finish_loss(terms.loss, entropy, terms.ratio, terms.kl, inputs, params, layout,
                       vespo_phi=terms.vespo_phi, entropy_mask=terms.entropy_mask)
