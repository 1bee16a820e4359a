"""grpo_kernels.trl.GRPOTrainer against TRL 1.16's trainer for GRPOConfig options in combination
(the loss matrix of one option at a time is tests/trl/test_trl.py's), and for the options that
shape the batch the loss sees, in short training runs: mask_truncated_completions (all-zero
completion masks), pad_to_multiple_of (completions wider than max_completion_length, dr_grpo's
normalizer), scale_rewards, gradient accumulation of 1 and 3 with num_iterations 2, gradient
checkpointing under LoRA, and the evaluation loop (num_generations_eval); and one generation
batch (reward_weights, multi_objective_aggregation, scale_rewards, unscored completions, the old
and reference log-probs at a sampling temperature)."""

import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from trl import GRPOConfig  # noqa: E402
from trl_harness import (  # noqa: E402
    DATASET,
    EOS,
    B,
    T,
    assert_same,
    digits_reward,
    make_trainer,
    run_both,
)

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

_g = torch.Generator().manual_seed(3)
_VLLM = dict(use_vllm=True, vllm_importance_sampling_correction=True)
TOOL_MASK = torch.ones(B, T, dtype=torch.long)
TOOL_MASK[0, 2:4] = 0
TOOL_MASK[2, 1] = 0
COMBINATIONS = {
    # sapo on sequence-level ratios, and with the KL's importance correction (TRL's default)
    "sapo-seq": dict(loss_type="sapo", importance_sampling_level="sequence", noise=1.0),
    "sapo-kl-corrected": dict(loss_type="sapo", beta=0.04, sapo_temperature_pos=0.5,
                              sapo_temperature_neg=2.0, noise=1.0),
    # delta caps the clipped types only: TRL's cispo and sapo ignore it
    "cispo-delta": dict(loss_type="cispo", delta=1.1, epsilon_high=1.1, noise=1.0),
    "sapo-delta": dict(loss_type="sapo", delta=1.1, noise=1.0),
    "dr_grpo-seq-delta-kl": dict(loss_type="dr_grpo", importance_sampling_level="sequence",
                                 delta=1.2, beta=0.04, noise=1.0),
    # the entropy mask times a sequence-level loss, and beside the KL (which it does not mask)
    "bnpo-seq-quantile": dict(loss_type="bnpo", importance_sampling_level="sequence",
                              top_entropy_quantile=0.4, noise=1.0),
    "luspo-quantile-kl": dict(loss_type="luspo", top_entropy_quantile=0.4, beta=0.04),
    "cispo-seq-offpolicy-quantile": dict(loss_type="cispo", epsilon_high=1.2,
                                         importance_sampling_level="sequence",
                                         off_policy_mask_threshold=0.05,
                                         top_entropy_quantile=0.6, noise=1.0),
    # token-level rollout ratios on a sequence-level loss: TRL broadcasts to [B, T]
    "luspo-seq-vllm-token": dict(loss_type="luspo", importance_sampling_level="sequence",
                                 noise=1.0, patch=_VLLM, extra=dict(
                                     importance_sampling_ratio=torch.rand(B, T, generator=_g)
                                     + 0.5)),
    # a tool mask in the quantile's tokens, the sequence means and the metrics
    "tool-quantile-entropy": dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.1,
                                  extra=dict(tool_mask=TOOL_MASK)),
    "tool-seq-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                        noise=1.0, extra=dict(tool_mask=TOOL_MASK)),
    "tool-quantile-padded": dict(loss_type="dapo", top_entropy_quantile=0.5, beta=0.04,
                                 padding_free=False, extra=dict(tool_mask=TOOL_MASK)),
    # evaluation: no accumulation scaling, no entropy controller step
    "eval-dr_grpo-quantile-entropy": dict(loss_type="dr_grpo", entropy_coef=0.1,
                                          top_entropy_quantile=0.5, mode="eval"),
    "eval-vespo-quantile-entropy": dict(loss_type="vespo", entropy_coef=0.1,
                                        top_entropy_quantile=0.5, mode="eval"),
    # quantile 0: only the highest-entropy token trains the policy and carries the bonus
    "quantile-0-entropy": dict(loss_type="bnpo", top_entropy_quantile=0.0, entropy_coef=0.1),
    # dapo on sequence-level ratios (TRL warns, and weights each sequence by its length)
    "dapo-seq-kl": dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.04,
                        noise=1.0),
    # per-token advantages on one ratio per sequence: clip flags and metrics per token
    "token-advantages-seq-delta-kl": dict(loss_type="grpo", importance_sampling_level="sequence",
                                          delta=1.1, beta=0.04, noise=1.0, extra=dict(
                                              advantages=torch.randn(B, T, generator=_g))),
    # the adaptive controller starting from 0: the bonus is on (policy_loss logged) at c = 0
    "adaptive-from-0": dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.0,
                            entropy_target=50.0, patch=dict(_last_world_entropy=1.0)),
    # vllm_importance_sampling_mode="token_mask": ratios out of bounds are 0 at real tokens
    # (1 at padding); vespo takes log(0) into φ as TRL does (floored at log 1e-8)
    "vespo-token-mask-ratios": dict(loss_type="vespo", patch=_VLLM, extra=dict(
        importance_sampling_ratio=torch.where(
            torch.arange(T)[None] < torch.tensor([[7], [3], [5], [1]]),
            (torch.rand(B, T, generator=_g) + 0.5) * (torch.arange(T) != 1), 1.0))),
}


@pytest.mark.parametrize("cfg", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_option_combinations_match_trl(model_dir, cfg):
    cfg = dict(cfg)
    mode = cfg.get("mode", "train")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run_both(model_dir, **cfg)
    assert not [str(w.message) for w in record if "grpo_kernels" in str(w.message)]
    assert_same(*result, mode=mode)


def test_vespo_at_sequence_level_is_vespo(model_dir):
    """vespo forms its own sequence weight: TRL warns at importance_sampling_level="sequence"
    and computes what it computes at token level (the KL's importance correction aside)."""
    for level in ("token", "sequence"):
        ref, ours, loss_ref, loss = run_both(model_dir, loss_type="vespo", beta=0.04,
                                             importance_sampling_level=level)
        # vespo's φ amplifies the float32 rounding of the summed log-ratio (as in
        # test_trl_loss_options.py)
        assert loss.item() == pytest.approx(loss_ref.item(), rel=3e-5)
        for k, v in ref._metrics["train"].items():
            assert ours._metrics["train"][k][-1] == pytest.approx(v[-1], rel=3e-5), k
        for p, q in zip(ref.model.parameters(), ours.model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=3e-5, atol=1e-6)


UNSCORED = []  # the completions a reward function left unscored (None), as they were seen


def digits_or_none(completions, **kwargs):
    """The digit count, or None (unscored) for an empty completion."""
    UNSCORED.extend(not c[0]["content"] for c in completions)
    return [None if not c[0]["content"] else float(sum(ch.isdigit() for ch in c[0]["content"]))
            for c in completions]


def length_mod_3(completions, **kwargs):
    """A second reward: length mod 3, None for an empty completion (no function scores it)."""
    return [None if not c[0]["content"] else float(len(c[0]["content"]) % 3)
            for c in completions]


# GRPOConfig fields shaping a generation batch: the advantages (reward weights, aggregation,
# scaling) and the old and reference log-probs scored inside generation (temperature)
GENERATION = {
    "weighted-sum-kl-iterations": dict(reward_weights=[1.0, -0.5], beta=0.04, num_iterations=2,
                                       temperature=0.7),
    "normalize-then-sum-kl": dict(multi_objective_aggregation="normalize_then_sum",
                                  reward_weights=[1.0, 2.0], beta=0.04),
    "batch-scale-truncated": dict(scale_rewards="batch", mask_truncated_completions=True,
                                  temperature=1.3),
}


@pytest.mark.parametrize("cfg", GENERATION.values(), ids=GENERATION.keys())
def test_generation_batch_matches_trl(model_dir, cfg):
    """One `_generate_and_score_completions` from the same seed: every tensor of the batch the
    loss will see (advantages, old and reference log-probs, ...) and every metric logged."""
    outputs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        trainer = make_trainer(cls, model_dir, reward_funcs=[digits_or_none, length_mod_3],
                               **cfg)
        trainer.model.train()
        UNSCORED.clear()
        torch.manual_seed(1)  # the sampling
        rows = [dict(DATASET[i]) for i in range(4) for _ in range(4)]  # 4 prompts × 4
        with force_backend("chunked"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batch = trainer._generate_and_score_completions(rows)
        outputs.append((batch, {k: v[-1] for k, v in trainer._metrics["train"].items()}))
    (want, want_metrics), (got, got_metrics) = outputs
    assert any(UNSCORED) and not all(UNSCORED)  # an unscored completion: its advantage is 0
    assert got.keys() == want.keys() and ("ref_per_token_logps" in want) == ("beta" in cfg)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: (
                f"{k}: {m}"))
    assert got_metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert got_metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), k


def _lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)


# GRPOConfig fields of a 3-step run; "check": what the batches the loss saw must show
RUNS = {
    "truncated-masked": dict(loss_type="dapo", beta=0.04, mask_truncated_completions=True,
                             check="an all-zero completion mask"),
    "padded-to-8-dr_grpo": dict(loss_type="dr_grpo", beta=0.04, pad_to_multiple_of=8,
                                scale_rewards="batch", check="8 completion columns"),
    "scale-none-bnpo-accumulation-1": dict(loss_type="bnpo", scale_rewards="none",
                                           gradient_accumulation_steps=1, beta=0.04),
    "vespo-accumulation-3-iterations-2": dict(loss_type="vespo", gradient_accumulation_steps=3,
                                              generation_batch_size=12, num_iterations=2,
                                              mask_truncated_completions=True),
    "lora-checkpointing-iterations-2": dict(loss_type="grpo", beta=0.04, entropy_coef=0.1,
                                            num_iterations=2, gradient_checkpointing=True,
                                            peft=True),
}


@pytest.mark.parametrize("cfg", RUNS.values(), ids=RUNS.keys())
def test_training_run_with_batch_options_matches_trl(model_dir, cfg):
    cfg = dict(cfg)
    check, lora = cfg.pop("check", None), cfg.pop("peft", False)
    runs, seen, init = [], [], None
    for cls in (trl.GRPOTrainer, GRPOTrainer):  # each built and trained in turn: one RNG stream
        trainer = make_trainer(cls, model_dir, max_steps=3, optim="sgd", learning_rate=0.1,
                               peft_config=_lora() if lora else None, **cfg)
        if init is None:
            init = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        else:
            trainer.model.load_state_dict(init)  # a LoRA adapter as TRL's trainer drew it
        if cls is GRPOTrainer:
            compute_loss = trainer._compute_loss

            def recording(model, inputs, compute_loss=compute_loss):
                seen.append(inputs["completion_mask"].clone())
                return compute_loss(model, inputs)

            trainer._compute_loss = recording
        with force_backend("chunked"), warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.train()
        runs.append(trainer)
    assert not [str(w.message) for w in record if "grpo_kernels" in str(w.message)]
    if check == "an all-zero completion mask":
        assert any((m.sum(1) == 0).any() for m in seen)
    if check == "8 completion columns":
        assert {m.shape[1] for m in seen} == {8} and cfg.get("pad_to_multiple_of") == 8
    ref, ours = runs
    logs = [h for h in ref.state.log_history if "loss" in h]
    assert len(logs) == 3
    for want, got in zip(logs, [h for h in ours.state.log_history if "loss" in h]):
        assert got.keys() == want.keys()
        for k, v in want.items():
            if k != "step_time":
                assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, want["step"])
    for p, q in zip(ref.model.parameters(), ours.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


def test_evaluation_loop_matches_trl(model_dir):
    """trainer.evaluate inside training (eval_strategy="steps"): the eval_* metrics, with
    num_generations_eval and the entropy options, are TRL's."""
    runs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        args = GRPOConfig(
            output_dir=f"{model_dir}/out", report_to=[], use_cpu=True, bf16=False, seed=0,
            per_device_train_batch_size=B, num_generations=4, max_completion_length=T,
            gradient_accumulation_steps=2, generation_batch_size=4 * B, logging_steps=1,
            max_steps=2, save_strategy="no", disable_tqdm=True, optim="sgd", learning_rate=0.1,
            generation_kwargs={"sequence_bias": [[[EOS], 3.5]]}, eval_strategy="steps",
            eval_steps=1, per_device_eval_batch_size=B, num_generations_eval=2,
            loss_type="dapo", beta=0.04, entropy_coef=0.1, top_entropy_quantile=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = cls(model=model_dir, reward_funcs=digits_reward, args=args,
                          train_dataset=DATASET, eval_dataset=DATASET)
            with force_backend("chunked"):
                trainer.train()
        runs.append([h for h in trainer.state.log_history if "eval_loss" in h])
    want, got = runs
    assert len(want) == len(got) == 2 and "eval_entropy" in want[0] and "eval_kl" in want[0]
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if "runtime" not in k and "per_second" not in k:
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
