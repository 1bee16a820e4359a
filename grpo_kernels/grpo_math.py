"""The GRPO per-token math and aggregation in PyTorch, on [B, T] tensors.

This is the one PyTorch implementation of GRPO_SPEC.md's per-token loss, aggregation and metrics.
The reference (`grpo_kernels.reference`), the chunked CPU path and the Triton sequence-level path
all call it on top of their own log-probs; the fused token-level Triton kernels carry the same
per-token math in a Triton epilogue (`epilogue.py`) and are cross-tested against this file.

Shapes: B sequences, T completion positions. `logp`, `old_logps`, `ref_logps`, `mask` are [B, T];
`advantages` is [B, 1] or [B, T]; `importance_sampling_ratio` is [B, 1] or [B, T].
"""

from __future__ import annotations

import torch

from .params import GRPOParams


def token_weights(
    mask: torch.Tensor,
    params: GRPOParams,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights of the loss type and the entropy-bonus normalizer.

    Every aggregation of GRPO_SPEC.md is Σ_bt weight[b,t]·ℓ[b,t], which lets the kernels take the
    weights as an input and stay generic over loss types. Padded positions always weigh 0.
    The entropy bonus is the masked mean entropy for every loss type (TRL 1.16), so its divisor
    is max(Σ mask, 1), never num_items_in_batch.
    mask [B, T] float32 -> (weight [B, T] float32, n: 0-dim float32, the entropy-bonus divisor)
    """
    B, _ = mask.shape
    n_tokens = mask.sum().clamp(min=1.0)
    lt = params.loss_type
    if lt in ("grpo", "sapo"):
        # mean over sequences of the per-sequence masked mean
        seq_len = mask.sum(-1, keepdim=True).clamp(min=1.0)
        weight = mask / (seq_len * B)
    elif lt == "bnpo":
        weight = mask / n_tokens
    elif lt == "dr_grpo":
        weight = mask / float(B * params.max_completion_length)
    elif lt in ("dapo", "cispo"):
        if num_items_in_batch is None:
            norm = n_tokens
        else:
            norm = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
            norm = norm.clamp(min=1.0)
        weight = mask / norm
    elif lt == "luspo":
        # mean over sequences of Σ_t mask·ℓ: a sequence weighs its length (TRL 1.16)
        weight = mask / float(max(B, 1))
    else:  # pragma: no cover - GRPOParams validated loss_type
        raise ValueError(f"unknown loss_type {lt!r}")
    return weight, n_tokens


def importance_log_weights(
    logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log w: [B, T] for "token"; [B, 1] masked mean of the log-ratio for "sequence" (GSPO)."""
    log_ratio = logp - old
    if level == "token":
        return log_ratio
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def per_token_loss(
    logp: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
    importance_sampling_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ℓ of GRPO_SPEC.md, differentiable w.r.t. logp.

    Returns (loss [B, T] or [B, 1], ratio w [B, T] or [B, 1] (detached), kl [B, T] or None).
    """
    old = logp.detach() if old_logps is None else old_logps
    log_w = importance_log_weights(logp, old, mask, params.importance_sampling_level)
    w = torch.exp(log_w)
    A = advantages
    lt = params.loss_type
    if lt == "cispo":
        loss = -torch.clamp(w, max=params.eps_high).detach() * A * logp
    elif lt == "sapo":
        t = torch.where(
            A > 0,
            torch.full_like(A, params.sapo_temperature_pos),
            torch.full_like(A, params.sapo_temperature_neg),
        )
        loss = -(torch.sigmoid(t * (w - 1)) * 4 / t) * A
    else:
        clipped = torch.clamp(w, 1 - params.epsilon_low, 1 + params.eps_high)
        unclipped = w if params.delta is None else torch.clamp(w, max=params.delta)
        loss = -torch.minimum(unclipped * A, clipped * A)
    if importance_sampling_ratio is not None:
        loss = loss * importance_sampling_ratio
    kl = None
    if params.beta != 0.0:
        d = ref_logps - logp
        kl = torch.exp(d) - d - 1
        if params.use_bias_correction_kl:
            kl = kl * w
        loss = loss + params.beta * kl
    return loss, w.detach(), kl


def clip_indicators(
    ratio: torch.Tensor, advantages: torch.Tensor, params: GRPOParams
) -> dict[str, torch.Tensor]:
    """The clip flags TRL 1.16 logs, as float 0/1 tensors (detached).

    ratio [B, T] or [B, 1] (sequence level), advantages [B, 1] or [B, T]; each flag has their
    broadcast shape. For the clipped types the ratio is the one in the unclipped term, i.e.
    after the `delta` cap; cispo's flag uses the raw ratio.
    """
    with torch.no_grad():
        A = advantages
        if params.is_clipped:
            w = ratio if params.delta is None else torch.clamp(ratio, max=params.delta)
            low = (w < 1 - params.epsilon_low) & (A < 0)
            high = (w > 1 + params.eps_high) & (A > 0)
            return {"clip_ratio/low_mean": low.float(), "clip_ratio/high_mean": high.float(),
                    "clip_ratio/region_mean": (low | high).float()}
        if params.loss_type == "cispo":
            return {"cispo_clip_ratio": ((ratio > params.eps_high) & (A > 0)).float()}
        return {}


def metric_sums(
    entropy: torch.Tensor,
    ratio: torch.Tensor,
    kl: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (sum, count), 0-dim float32 each; the metric is sum / max(count, 1).

    As TRL 1.16 logs them: a [B, T] quantity is summed over real tokens (count Σ mask); a quantity
    with one value per sequence ([B, 1]: the clip flags at importance_sampling_level="sequence")
    is summed over all B sequences, fully masked ones included (count B). Sums and counts, not
    means, so that a trainer can add them up across processes before dividing.
    """
    with torch.no_grad():
        maskf = mask.float()

        def terms(x):
            x = x.float()
            if x.shape[-1] == 1:  # one value per sequence: the plain mean over the B rows
                return x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            return (torch.broadcast_to(x, maskf.shape) * maskf).sum(), maskf.sum()

        sums = {"entropy": terms(entropy)}
        if kl is not None:
            sums["kl"] = terms(kl)
        for name, flag in clip_indicators(ratio, advantages, params).items():
            sums[name] = terms(flag)
    return sums


def grpo_metrics(
    entropy: torch.Tensor,
    ratio: torch.Tensor,
    kl: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: GRPOParams,
) -> dict[str, torch.Tensor]:
    """The loss metrics of one process (detached 0-dim float32): entropy, kl (beta != 0), the
    clip ratios; see `metric_sums` for how each is averaged."""
    return {name: total / count.clamp(min=1.0)
            for name, (total, count) in metric_sums(entropy, ratio, kl, advantages, mask,
                                                    params).items()}


def mean_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entropy bonus's H: Σ mask·entropy / max(Σ mask, 1), differentiable (TRL 1.16 uses
    this masked mean for every loss type). entropy, mask [B, T] -> 0-dim."""
    return (entropy * mask).sum() / mask.sum().clamp(min=1.0)


def grpo_loss_from_logps(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    params: GRPOParams,
    num_items_in_batch: float | torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss and metrics from per-token log-probs and entropies (all [B, T] float32).

    Gradients flow into `logp` (and into `entropy` when entropy_coef != 0).
    """
    loss_tok, ratio, kl = per_token_loss(
        logp, old_logps, ref_logps, advantages, mask, params, importance_sampling_ratio
    )
    weight, _ = token_weights(mask, params, num_items_in_batch)
    loss = (weight * loss_tok).sum()
    if params.entropy_coef != 0.0:
        loss = loss - params.entropy_coef * mean_entropy(entropy, mask)
    return loss, grpo_metrics(entropy.detach(), ratio, kl, advantages, mask, params)
