"""The TRL subclass against TRL 1.16's trainer with the loss options that need whole sequences
or the batch (vespo, top_entropy_quantile, off_policy_mask_threshold, use_adaptive_entropy): one
batch for each option with no fallback warning, micro-batches with one or every completion
masked out (packed and padded), and a short training run with every option (the
adaptive entropy controller included). The functions against TRL's `_compute_loss` are in
tests/api/test_loss_options.py."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

from grpo_kernels import force_backend

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
pytest.importorskip("datasets")
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from grpo_kernels.trl import GRPOTrainer  # noqa: E402
from grpo_train.tiny import build_tokenizer, save_tiny_model  # noqa: E402

MB, P, TC = 4, 5, 7  # micro-batch, prompt length, completion length (as tests/trl/test_trl.py)
EOS = build_tokenizer().eos_token_id
DATASET = Dataset.from_dict(
    {"prompt": [[{"role": "user", "content": f"{i}+{2 * i}"}] for i in range(8)]})


def digits_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c[0]["content"]) for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(str(path), hidden_size=32, num_layers=2)
    return str(path)


def make_trainer(cls, model_dir, padding_free=True, **overrides):
    """A tiny trainer of class `cls` (padding_free goes to ours only)."""
    cfg = dict(
        output_dir=f"{model_dir}/out", report_to=[], use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=MB, num_generations=4, max_completion_length=TC,
        gradient_accumulation_steps=2, generation_batch_size=4 * MB, logging_steps=1,
        max_steps=2, save_strategy="no", disable_tqdm=True,
        generation_kwargs={"sequence_bias": [[[EOS], 3.5]]},  # completions of varied lengths
    )
    cfg.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = {} if cls is trl.GRPOTrainer else dict(padding_free=padding_free)
        return cls(model=model_dir, reward_funcs=digits_reward, args=GRPOConfig(**cfg),
                   train_dataset=DATASET, **ours)


def trainer_batch(trainer, seed=0, noise=0.5, lengths=(7, 3, 5, 1)):
    """A TRL micro-batch: completions of `lengths` (0: a completion masked out, as TRL's
    mask_truncated_completions leaves a truncated one), old/ref/sampling log-probs near the
    policy's (TRL's scoring + noise, one unscored sampling token), rollout ratios."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, 90, (MB, P), generator=g)
    prompt_mask = torch.ones(MB, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completion_mask = (torch.arange(TC)[None] < torch.tensor(lengths)[:, None]).long()
    completion_ids = torch.randint(10, 90, (MB, TC), generator=g).masked_fill(
        completion_mask == 0, 0)
    with torch.no_grad():
        logps, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), TC)
    noisy = lambda: (logps + noise * torch.randn(MB, TC, generator=g)) * completion_mask  # noqa
    sampling = noisy()
    sampling[1, 0] = math.nan
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask,
                advantages=torch.tensor([0.7, -1.2, -0.4, 0.9]),
                num_items_in_batch=completion_mask.sum().float() * 4,
                old_per_token_logps=noisy(), ref_per_token_logps=noisy(),
                sampling_per_token_logps=sampling,
                importance_sampling_ratio=torch.where(
                    completion_mask.bool(), 0.6 + 0.8 * torch.rand(MB, TC, generator=g), 1.0))


def no_fallback_warning(record) -> None:
    ours = [str(w.message) for w in record if "grpo_kernels.trl" in str(w.message)]
    assert not ours, ours


TRAINER_CASES = {
    "vespo-kl": dict(loss_type="vespo", beta=0.04),
    "vespo-rollout-ratios": dict(loss_type="vespo", vespo_k_neg=1.5, patch=dict(
        use_vllm=True, vllm_importance_sampling_correction=True)),
    "quantile-grpo-entropy": dict(loss_type="grpo", top_entropy_quantile=0.3,
                                  entropy_coef=0.1),
    "offpolicy-dapo": dict(loss_type="dapo", beta=0.04, off_policy_mask_threshold=0.05),
    # entropy at or below the target since the last step: the coefficient applies and rises
    "adaptive-on": dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.1,
                        entropy_target=50.0, top_entropy_quantile=0.5,
                        patch=dict(_last_world_entropy=1.0)),
    "adaptive-off": dict(loss_type="cispo", epsilon_high=1.2, use_adaptive_entropy=True,
                         entropy_coef=0.1, entropy_target=0.2),
    # advantages per token ([B, T], as TRL's subclasses may give them): φ per token too
    "vespo-token-advantages": dict(loss_type="vespo", off_policy_mask_threshold=0.05, batch=dict(
        advantages=torch.linspace(-1.5, 1.5, MB * TC).reshape(TC, MB).T.contiguous())),
}


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_trainer_matches_trl_without_fallback(model_dir, case):
    assert_matches_trl(model_dir, dict(TRAINER_CASES[case]))


# every option on, for micro-batches with completions masked out: one, or all of them (every
# completion truncated under mask_truncated_completions: no token to take a quantile of)
MASKED_OUT = dict(loss_type="grpo", beta=0.04, top_entropy_quantile=0.5, entropy_coef=0.1,
                  off_policy_mask_threshold=0.05)


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("lengths", [(7, 0, 5, 1), (0, 0, 0, 0)], ids=["one", "all"])
def test_masked_out_completions_match_trl(model_dir, lengths, padding_free):
    assert_matches_trl(model_dir, dict(MASKED_OUT), lengths=lengths, padding_free=padding_free)


def assert_matches_trl(model_dir, cfg, lengths=(7, 3, 5, 1), padding_free=True):
    """One `_compute_loss` of TRL's trainer and ours (config `cfg`, its "patch" set on both
    trainers, its "batch" replacing entries of `trainer_batch`): no fallback warning; the same
    loss, gradients, metrics and entropy controller state."""
    patch, batch = cfg.pop("patch", {}), cfg.pop("batch", {})
    ref = make_trainer(trl.GRPOTrainer, model_dir, **cfg)
    ours = make_trainer(GRPOTrainer, model_dir, padding_free=padding_free, **cfg)
    assert ours._loss_fallback is None
    for tr in (ref, ours):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
        for k, v in patch.items():
            setattr(tr, k, v)
    inputs = {**trainer_batch(ref, lengths=lengths), **batch}
    loss_ref = ref._compute_loss(ref.model, inputs)
    loss_ref.backward()
    with force_backend("torch"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = ours._compute_loss(ours.model, inputs)
        loss.backward()
    no_fallback_warning(record)
    # vespo's φ = exp(λ + k·log w − λ·w) amplifies the float32 rounding of the summed log-ratio
    # (both trainers compute log-probs in float32, by different matmuls) by |k − λ·w|; the
    # others differ by float32 sums in another order (3e-7 at a loss of 0.19 on one AMD EPYC)
    rtol = 3e-5 if cfg["loss_type"] == "vespo" else 1e-5
    torch.testing.assert_close(loss, loss_ref, rtol=rtol, atol=1e-6)
    scale = max(p.grad.abs().max() for p in ref.model.parameters())
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=max(rtol, 1e-5), atol=1e-6 * scale,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
    got, want = ({k: v[-1] for k, v in tr._metrics["train"].items()} for tr in (ours, ref))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=max(rtol, 1e-5), abs=1e-6, nan_ok=True), k
    assert ours.entropy_coef == pytest.approx(ref.entropy_coef)
    assert ours._last_world_entropy == pytest.approx(ref._last_world_entropy, rel=1e-5)


def test_training_run_with_every_option_matches_trl(model_dir):
    """Three optimizer steps of two micro-batches: vespo, the entropy quantile, the off-policy
    mask and the adaptive controller (its target above the entropy: it engages after step 1)."""
    cfg = dict(loss_type="vespo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.05,
               use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.05,
               entropy_target=50.0, max_steps=3, optim="sgd", learning_rate=0.1)
    runs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        trainer = make_trainer(cls, model_dir, **cfg)
        with force_backend("torch"), warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.train()
        runs.append(trainer)
    no_fallback_warning(record)
    ref, ours = runs
    logs = [h for h in ref.state.log_history if "loss" in h]
    assert len(logs) == 3 and [h["entropy_coef"] for h in logs] == pytest.approx(
        [0.1, 0.15, 0.2])
    for want, got in zip(logs, [h for h in ours.state.log_history if "loss" in h]):
        for k in ("loss", "grad_norm", "entropy", "vespo/phi_seq_mean", "policy_loss",
                  "entropy_coef", "reward"):
            if k not in want:  # rewards are logged at generation steps only
                continue
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (k, want["step"])
    for p, q in zip(ref.model.parameters(), ours.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


def test_fsdp_forward_method_keeps_the_terms_named():
    """Under FSDP2 the loss runs through `_call_forward`, which copies views among the outputs:
    the GRPOTerms the subclass reads by name must come back as GRPOTerms."""
    from grpo_kernels import GRPOTerms
    from grpo_kernels.hf.fsdp import _call_forward

    class Root:  # an FSDP2 root's state, without parameter groups to keep unsharded
        def _get_fsdp_state(self):
            return types.SimpleNamespace()

    x = torch.arange(6.0).reshape(2, 3)
    terms = GRPOTerms(x.sum(), x[:, 1:], x, x[:, :1], None)
    out = _call_forward(Root(), lambda _: terms, None)
    assert type(out) is GRPOTerms and out.kl is None and out.vespo_phi is None
    assert not out.logp._is_view() and torch.equal(out.logp, x[:, 1:])


def test_entropy_quantile_takes_the_real_tokens_only():
    """torch's quantile refuses more than 2**24 values. TRL's takes the threshold over the real
    tokens of every process; so must ours, however much padding the [B, T] grid holds (a long
    max_completion_length, many processes)."""
    import accelerate

    from grpo_kernels.grpo_options import high_entropy_mask
    from grpo_kernels.trl.bookkeeping import LossBookkeeping

    trainer = LossBookkeeping()
    trainer.accelerator = accelerate.Accelerator(cpu=True)
    B, T = 4, 2**22 + 8  # B·T > 2**24, 30 real tokens
    g = torch.Generator().manual_seed(0)
    entropy = torch.zeros(B, T)
    entropy[:, :10] = torch.rand(B, 10, generator=g) * 3
    mask = (torch.arange(T)[None] < torch.tensor([10, 3, 0, 7])[:, None]).float()
    got = high_entropy_mask(entropy, mask, 0.3, gather=trainer._gather_entropies)
    want = trl.GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask, 1 - 0.3)
    assert torch.equal(got.bool(), want) and 0 < want.sum() < mask.sum()
