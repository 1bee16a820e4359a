"""TRL 1.16's own `GRPOTrainer._compute_loss` on a batch of hidden states, without a model or a
trainer: the reference the loss-semantics tests compare ours against (tests/api/)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import trl

from grpo_kernels.params import VESPO_FIELDS, GRPOParams
from grpo_kernels.reference import logprobs_from_logits


def trl_loss(batch, hp, sampling=False, isr=False):
    """TRL's `_compute_loss` on the batch: (loss, grad of hidden, grad of weight, metrics).

    batch: hidden [B, T, D], weight [V, D], ids, mask [B, T], advantages [B], old, ref [B, T],
    num_items (and sampling, isr [B, T]); the policy's log-probs are those of hidden @ weight.T.
    hp: our hyperparameter names (absent options off). sampling: the batch carries
    sampling_per_token_logps; isr: rollout ratios with TRL's vLLM correction on."""
    hidden = batch["hidden"].clone().requires_grad_(True)
    weight = batch["weight"].clone().requires_grad_(True)
    B = batch["ids"].shape[0]

    def scoring(model, input_ids, attention_mask, logits_to_keep, **_):
        logp, ent = logprobs_from_logits(hidden @ weight.T, batch["ids"],
                                         temperature=hp["temperature"], return_entropy=True)
        return logp, ent, None

    identity = lambda x, **_: x  # noqa: E731 - one process: gather/reduce/pad change nothing
    defaults = GRPOParams()
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=scoring,
        top_entropy_quantile=hp.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=hp.get("off_policy_mask_threshold"),
        get_off_policy_mask=trl.GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
        importance_sampling_level=hp["importance_sampling_level"], beta=hp["beta"],
        loss_type=hp["loss_type"], epsilon_low=hp["epsilon_low"],
        epsilon_high=hp["epsilon_high"], use_vllm=isr, vllm_importance_sampling_correction=isr,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=hp["max_completion_length"],
        accelerator=SimpleNamespace(num_processes=1, gather=identity, reduce=identity,
                                    pad_across_processes=identity, sync_gradients=True),
        args=SimpleNamespace(delta=hp.get("delta"),
                             use_bias_correction_kl=hp.get("use_bias_correction_kl",
                                                           defaults.use_bias_correction_kl),
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                             steps_per_generation=1,
                             **{k: hp.get(k, getattr(defaults, k)) for k in VESPO_FIELDS}),
        _entropy_bonus_enabled=hp["entropy_coef"] != 0.0, entropy_coef=hp["entropy_coef"],
        use_adaptive_entropy=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    stand_in.get_high_entropy_mask = lambda *a: trl.GRPOTrainer.get_high_entropy_mask(
        stand_in, *a)
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long),
                  prompt_mask=torch.ones(B, 1, dtype=torch.long), completion_ids=batch["ids"],
                  completion_mask=batch["mask"].long(), advantages=batch["advantages"],
                  num_items_in_batch=batch["num_items"], old_per_token_logps=batch["old"],
                  ref_per_token_logps=batch["ref"],
                  **({"sampling_per_token_logps": batch["sampling"]} if sampling else {}),
                  **({"importance_sampling_ratio": batch["isr"]} if isr else {}))
    loss = trl.GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in stand_in._metrics["train"].items()}
    return loss.detach(), hidden.grad, weight.grad, metrics


def assert_close_to_trl(got, want, tol, label):
    """Our (loss, grad of hidden, grad of weight, metrics) against `trl_loss`'s: the loss and
    each metric to `tol`, each gradient to `tol` of its largest entry. TRL logs more metrics
    than a loss returns (policy_loss, per-sequence extremes: the TRL subclass's part), so ours
    must be a subset."""
    loss, g_hidden, g_weight, metrics = got
    want_loss, want_hidden, want_weight, want_metrics = want
    torch.testing.assert_close(loss.double(), want_loss, rtol=tol, atol=tol,
                               msg=lambda m: f"{label} loss: {m}")
    for name, g, w in (("hidden", g_hidden, want_hidden), ("weight", g_weight, want_weight)):
        scale = w.abs().max().item()
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * scale,
                                   msg=lambda m, n=name: f"{label} grad of {n}: {m}")
    assert metrics.keys() <= want_metrics.keys(), (label, metrics.keys(), want_metrics.keys())
    for k, v in metrics.items():
        assert v == pytest.approx(want_metrics[k], rel=tol, abs=tol), (label, k)
