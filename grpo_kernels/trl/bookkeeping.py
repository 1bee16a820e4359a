"""TRL's loss bookkeeping around the fused loss, as a mixin of `grpo_kernels.trl.GRPOTrainer`:
the normalization per micro-batch, the entropy bonus's coefficient (adaptive included; the loss
adds the bonus itself), and the loss metrics reduced across processes, each as TRL 1.16's
`_compute_loss` does it (docs/semantics.md, "What the TRL subclass adds").

The methods read the trainer's TRL attributes (accelerator, args, _metrics, entropy_coef,
_last_world_entropy, _entropy_window_stats, ...) and the subclass's _grpo_params and
_entropy_control.
"""

from __future__ import annotations

import dataclasses

import torch
from trl.trainer.utils import nanmax, nanmin

from ..grpo_math import clip_indicators, metric_sums
from ..grpo_options import masked_sums


class LossBookkeeping:
    """The per-micro-batch bookkeeping of TRL's loss (mixed into the TRL subclass)."""

    def _gather_entropies(self, values: torch.Tensor) -> torch.Tensor:
        """The real tokens' entropies of every process, for the top_entropy_quantile threshold
        over the whole batch, as TRL takes it. values: this process's [B·T] (or packed [N])
        entropies, NaN at padding. Only real tokens are exchanged and returned: torch's
        quantile refuses more than 2**24 values, and TRL's takes the real tokens only."""
        real = values[~values.isnan()]  # [n] this process's real tokens
        padded = self.accelerator.pad_across_processes(real, dim=0, pad_index=float("nan"))
        gathered = self.accelerator.gather(padded)
        return gathered[~gathered.isnan()]

    def _loss_params(self, mode: str, scale, accumulation: int):
        """The GRPOParams of this micro-batch's loss: TRL's, with the entropy bonus's
        coefficient, which the loss adds itself (so that the route needs no differentiable
        entropy). TRL's bonus is coef × the masked mean entropy over the tokens the policy loss
        acts on, scaled only for accumulation, while the trainer multiplies the loss by `scale`:
        the coefficient given is coef / (accumulation · scale). coef is the one set at the
        previous optimizer step (adaptive gate included), as TRL applies it."""
        if not self._entropy_bonus_enabled:
            return self._grpo_params
        coef = self.entropy_coef
        if self._entropy_control is not None:
            coef = self._entropy_control.applied_coef(coef, self._last_world_entropy)
        return dataclasses.replace(self._grpo_params,
                                   entropy_coef=float(coef) / (accumulation * float(scale)))

    def _entropy_bookkeeping(self, mode: str, t, maskf, scale) -> None:
        """After the loss: its policy_loss and entropy_coef logs, and the adaptive
        controller's step at the end of an accumulation window. t: the loss's detached
        GRPOTerms (entropy, entropy mask)."""
        bonus_mask = maskf if t.entropy_mask is None else maskf * t.entropy_mask
        token_count = self._grpo_params.normalizes_by_token_count
        logged = t.policy_loss * (scale if token_count else 1)
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(logged).nanmean().item())
        if self._entropy_control is not None and mode == "train":
            self._adaptive_entropy_step(masked_sums(t.entropy, bonus_mask))
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _adaptive_entropy_step(self, sums: torch.Tensor) -> None:
        """Adds this micro-batch's [Σ entropy, tokens] to the window; at the optimizer step, the
        window's mean over all processes moves the coefficient for the next step. The state is
        TRL's own attributes (its checkpoints save entropy_coef and _last_world_entropy)."""
        window = self._entropy_window_stats
        self._entropy_window_stats = sums if window is None else window + sums
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = self._entropy_control.window_entropy(totals)
        self.entropy_coef = self._entropy_control.next_coef(self.entropy_coef, world_entropy)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _normalizer(self, inputs, mode: str, accumulation: int):
        """(num_items_in_batch for our loss, factor applied to our loss) reproducing TRL's
        normalization of self.loss_type."""
        if self._grpo_params.normalizes_by_token_count:
            # num_items_in_batch counts the whole generation batch on all processes; TRL rescales
            # it to one accumulation window of this process
            n = torch.as_tensor(inputs["num_items_in_batch"], dtype=torch.float32)
            norm = n.clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                norm = norm * accumulation / self.args.steps_per_generation
            # our loss clamps its normalizer at 1 and TRL's rescaled one is not; undo our clamp
            return norm, norm.clamp(min=1.0) / norm
        return None, 1.0 / accumulation

    def _log_metrics(self, mode, maskf, entropy, ratio, kl, advantages, vespo_phi=None) -> None:
        """TRL's loss metrics: `grpo_math.metric_sums` added up across processes, and the
        per-sequence min/max of the clip fractions."""
        metrics = self._metrics[mode]
        # TRL's per-token tensors are zero at padded positions; zero ours too (it matters only
        # where a [B, 1] completion makes a per-token value count as a per-sequence one)
        on_tokens = lambda x: x * maskf if x.shape == maskf.shape else x  # noqa: E731
        p = self._grpo_params
        A = advantages.to(ratio.device)
        sums = metric_sums(on_tokens(entropy.float()), ratio, None if kl is None else
                           on_tokens(kl.float()), A, maskf, p, vespo_phi=vespo_phi)
        names = list(sums)
        totals = self.accelerator.reduce(
            torch.stack([torch.stack(sums[k]) for k in names]), reduction="sum")  # [K, 2]
        means = (totals[:, 0] / totals[:, 1].clamp(min=1.0)).tolist()
        for name, value in zip(names, means):
            metrics[name].append(value)

        def per_sequence(x):  # [B]: NaN for a sequence without tokens (dropped by nanmin/max)
            return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

        flags = clip_indicators(ratio, A, p)
        if "clip_ratio/low_mean" in flags:
            gathered = self.accelerator.gather(per_sequence(flags["clip_ratio/low_mean"]))
            metrics["clip_ratio/low_min"].append(nanmin(gathered).item())
            gathered = self.accelerator.gather(per_sequence(flags["clip_ratio/high_mean"]))
            metrics["clip_ratio/high_max"].append(nanmax(gathered).item())
