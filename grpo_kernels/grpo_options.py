"""The loss options that need a whole sequence or the whole batch, in PyTorch, on [B, T] tensors.

`grpo_math` (the per-token loss, weights, bonus and metrics) calls these; the semantics are in
docs/semantics.md ("Sequence and batch options"). None of them can run in the per-token Triton
epilogue, so a loss that uses one takes the selective log-prob op and `grpo_math`
(`loss_call.takes_terms_op`):

    compute_vespo_phi  vespo's per-sequence weight φ(w) of the summed log-ratio
    off_policy_mask    drops negative-advantage sequences that drifted too far from the sampler
    high_entropy_mask  keeps the tokens at or above an entropy quantile of the batch
    EntropyController  the adaptive entropy coefficient (trainer state lives with the caller)

Shapes as in `grpo_math`: per-token [B, T] (packed [N]), per-sequence [B, 1] (packed [S, 1]);
each function takes the batch's token `layout` (`token_layouts.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .traced_floats import traced

# vespo works in log space; TRL 1.16 clamps the token log-ratios to ±20 and the sequence log-weight
# (and each log rollout ratio) to [log 1e-8, 20], which these constants reproduce.
_TOKEN_LOG_RATIO_BOUND = 20.0
_LOG_WEIGHT_FLOOR = math.log(1e-8)
_LAMBDA_FLOOR = 1e-4


@torch.no_grad()
def compute_vespo_phi(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  importance_sampling_ratio: torch.Tensor | None, params, layout) -> torch.Tensor:
    """vespo's φ = exp(λ + k·log w − λ·w), detached, with log w the sequence's summed (not
    averaged) token log-ratio plus the summed log rollout ratios; k, λ by the sign of A.

    log_ratio, mask [B, T]; advantages [B, 1] or [B, T]; importance_sampling_ratio [B, T] or
    [B, 1] or None. Returns φ [B, 1] ([B, T] for per-token advantages); packed: [S, 1] or [N].
    The rollout ratios are summed over every position given, padding included (TRL does; its
    ratios are 1 there)."""
    clamped = log_ratio.clamp(-_TOKEN_LOG_RATIO_BOUND, _TOKEN_LOG_RATIO_BOUND)
    log_w = layout.seq_sum(clamped * mask)  # [B, 1]
    if importance_sampling_ratio is not None:
        log_is = torch.log(importance_sampling_ratio).clamp(_LOG_WEIGHT_FLOOR, 20.0)
        log_w = log_w + (log_is if layout.per_sequence(log_is) else layout.seq_sum(log_is))
    log_w = log_w.clamp(_LOG_WEIGHT_FLOOR, 20.0)
    log_w, A = layout.align(log_w, advantages)
    nonneg = A >= 0
    k = _by_sign(nonneg, params.vespo_k_pos, params.vespo_k_neg)
    lam = _by_sign(nonneg, params.vespo_lambda_pos, params.vespo_lambda_neg).clamp(
        min=_LAMBDA_FLOOR)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _by_sign(nonneg: torch.Tensor, pos: float, neg: float) -> torch.Tensor:
    """torch.where(nonneg, pos, neg) of two hyperparameters, in the default dtype as torch.where
    of two Python numbers; under torch.compile of two 0-d tensors, which keep them symbolic
    (`traced_floats.traced`)."""
    dtype = torch.get_default_dtype()
    return torch.where(nonneg, traced(pos, nonneg, dtype), traced(neg, nonneg, dtype))


@torch.no_grad()
def off_policy_mask(logp: torch.Tensor, sampling_logps: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, threshold: float, layout) -> torch.Tensor:
    """1.0 where a sequence is kept: A >= 0, or its masked mean of (sampling − current) log-prob
    is <= threshold; 0.0 drops it. A NaN sampling log-prob (a token the sampler could not score)
    counts as no drift.

    logp, sampling_logps, mask [B, T]; advantages [B, 1] or [B, T]. Returns float32 [B, 1]
    ([B, T] for per-token advantages); packed: [S, 1] or [N]."""
    drift = torch.nan_to_num(sampling_logps - logp.detach(), nan=0.0)
    mean_drift = layout.seq_sum(drift * mask) / layout.seq_sum(mask).clamp(min=1.0)  # [B, 1]
    mean_drift, A = layout.align(mean_drift, advantages)
    return ((A >= 0) | (mean_drift <= threshold)).float()


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """1.0 for real tokens whose entropy is >= the (1 − quantile) quantile (linear interpolation)
    of the real tokens' entropies; 0.0 elsewhere. No real token anywhere: all zeros.

    entropy, mask [B, T] (packed [N]) -> float32, same shape. The quantile is taken over this
    batch, or over every process's when `gather` is given: it maps this process's [B·T] entropies,
    NaN at padding, to the concatenation of all processes' (NaN entries are ignored, so it may
    pad with NaN). NaN marks padding so that the quantile needs no data-dependent shape."""
    real = mask.bool()
    values = torch.where(real, entropy.float(), torch.nan).reshape(-1)
    if gather is not None:
        values = gather(values)
    if values.numel() == 0:  # packed rows of no token anywhere (e.g. every completion truncated
        # under mask_truncated_completions): nanquantile refuses an empty tensor; keep none
        return torch.zeros_like(entropy, dtype=torch.float32)
    threshold = nanquantile(values, 1.0 - quantile)  # NaN if no real token: keeps none
    return ((entropy * mask.float() >= threshold) & real).float()


# torch.quantile and torch.nanquantile refuse inputs of more than 2**24 elements.
_QUANTILE_LIMIT = 2**24


def nanquantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.nanquantile(values, q) (linear interpolation, NaN entries ignored) for a 1-D float
    tensor of any length: torch's own up to its 2**24-element limit, above it and under
    torch.compile the same steps written out (a sort puts the NaNs last; with n real values the
    rank q·(n − 1) lies between two sorted entries, and lerp interpolates them), equal to
    torch's bit for bit. Returns a 0-d tensor, NaN if every entry is NaN. The shapes do not
    depend on the data, so it traces under torch.compile; there torch.nanquantile's float q
    would fix a symbolic q (a schedule of top_entropy_quantile) to its value, a graph per
    value, where the product q·(n − 1) keeps it symbolic."""
    if values.numel() <= _QUANTILE_LIMIT and not torch.compiler.is_compiling():
        return torch.nanquantile(values, q)
    ordered = values.sort().values  # [M], NaN last
    n = (~values.isnan()).sum()  # 0-d int64: the real values
    rank = q * (n - 1).clamp(min=0).to(values.dtype)  # 0-d
    below = rank.floor()
    # [1] indices: gather, not indexing by a 0-d tensor (which torch.compile reads as a number)
    lo = below.long().clamp(max=values.numel() - 1).reshape(1)
    hi = rank.ceil().long().clamp(max=values.numel() - 1).reshape(1)
    out = torch.lerp(ordered.gather(0, lo), ordered.gather(0, hi), rank - below).reshape(())
    return torch.where(n > 0, out, torch.nan)


def masked_sums(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[Σ mask·entropy, Σ mask] as one detached float32 [2] tensor (one reduction across
    processes gives the global mean)."""
    with torch.no_grad():
        maskf = mask.float()
        # 0 at padding whatever its entropy (NaN for non-finite logits)
        ent = torch.where(maskf != 0, entropy.float() * maskf, 0.0)
        return torch.stack([ent.sum(), maskf.sum()])


@dataclass(frozen=True)
class EntropyController:
    """The adaptive entropy coefficient (TRL's `use_adaptive_entropy`), as pure functions of the
    state its caller keeps: the coefficient, and the mean entropy measured at the end of the
    previous optimizer step (inf before the first).

    Per step: every micro-batch applies `applied_coef(coef, last_entropy)`; the caller adds up
    `masked_sums` of the micro-batches of the accumulation window (over processes too), and at
    the optimizer step sets coef = next_coef(coef, window mean) and last_entropy = window mean.
    """

    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0

    def __post_init__(self) -> None:
        for name in ("entropy_target", "entropy_coef_delta", "entropy_coef_min",
                     "entropy_coef_max"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.entropy_coef_delta < 0:
            raise ValueError(f"entropy_coef_delta must be >= 0, got {self.entropy_coef_delta}")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError("entropy_coef_min must be <= entropy_coef_max, got "
                             f"{self.entropy_coef_min} > {self.entropy_coef_max}")

    @classmethod
    def from_config(cls, config) -> EntropyController:
        """From an object with these attribute names (a TRL GRPOConfig)."""
        return cls(config.entropy_target, config.entropy_coef_delta, config.entropy_coef_min,
                   config.entropy_coef_max)

    def applied_coef(self, coef: float, last_entropy: float) -> float:
        """The coefficient of the bonus this step: coef while the last measured entropy is at or
        below the target, 0 above it (and before the first measurement)."""
        return coef if last_entropy <= self.entropy_target else 0.0

    def next_coef(self, coef: float, entropy: float) -> float:
        """One step of the controller: up by delta when entropy <= target, else down by delta,
        kept within [entropy_coef_min, entropy_coef_max]."""
        if entropy <= self.entropy_target:
            return min(coef + self.entropy_coef_delta, self.entropy_coef_max)
        return max(coef - self.entropy_coef_delta, self.entropy_coef_min)

    @staticmethod
    def window_entropy(sums: torch.Tensor) -> float:
        """The mean entropy of a window from its summed `masked_sums` [2]."""
        return (sums[0] / sums[1].clamp(min=1.0)).item()
