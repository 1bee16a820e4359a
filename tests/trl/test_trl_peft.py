"""grpo_kernels.trl.GRPOTrainer against TRL 1.16's trainer on PEFT models beyond LoRA on the
body and the head (tests/trl/test_trl.py): other adapter types on the body, a trained copy of
the head (modules_to_save), and prompt-learning adapters, which put virtual tokens before every
sequence in the PEFT model's forward and so run padded rows (a packed or shared row would give
them to its first sequence only)."""

import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
pytest.importorskip("datasets")
from trl_harness import assert_same, make_batch, make_trainer  # noqa: E402

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.hf import RowLayout  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ADAPTERS = {
    "ia3": lambda: peft.IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "down_proj"],
                                  feedforward_modules=["down_proj"], init_ia3_weights=False),
    "lora-head-copy": lambda: peft.LoraConfig(r=4, target_modules=["q_proj"],
                                              modules_to_save=["lm_head"],
                                              init_lora_weights=False),
    "lora-embedding": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"],
                                              init_lora_weights=False),
    "prompt-tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "prefix-tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
}
PROMPT_LEARNING = ("prompt-tuning", "prefix-tuning")


def both_trainers(model_dir, peft_config, **cfg):
    """TRL's trainer and ours on the same adapter weights (each draws its own at wrapping)."""
    ref = make_trainer(trl.GRPOTrainer, model_dir, peft_config=peft_config, **cfg)
    ours = make_trainer(GRPOTrainer, model_dir, peft_config=peft_config, **cfg)
    ours.model.load_state_dict(ref.model.state_dict())
    return ref, ours


@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_compute_loss_matches_trl(model_dir, name):
    ref, ours = both_trainers(model_dir, ADAPTERS[name](), loss_type="dapo", beta=0.04,
                              entropy_coef=0.05)
    for tr in (ref, ours):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
    inputs = make_batch(ref)
    loss_ref = ref._compute_loss(ref.model, inputs)
    loss_ref.backward()
    with force_backend("chunked"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = ours._compute_loss(ours.model, inputs)
        loss.backward()
    assert not [w for w in record if "grpo_kernels" in str(w.message)]
    assert_same(ref, ours, loss_ref, loss)
    assert (ours._layout is RowLayout.PADDED) == (name in PROMPT_LEARNING)
    trained = [(n, p) for n, p in ours.model.named_parameters() if p.requires_grad]
    # the head's trained copy and the virtual tokens get their gradient
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in trained
                           if "modules_to_save" in n or "prompt_encoder" in n), name


def test_prompt_tuning_training_run_matches_trl(model_dir):
    """Old- and reference-policy scoring too (num_iterations 2; beta > 0 scores the reference
    with the adapter off): three SGD steps end with TRL's logs and parameters."""
    cfg = dict(loss_type="dapo", beta=0.04, num_iterations=2, max_steps=3, optim="sgd",
               learning_rate=0.1)
    runs, before = [], None
    for cls in (trl.GRPOTrainer, GRPOTrainer):  # each built and trained in turn: one RNG stream
        trainer = make_trainer(cls, model_dir, peft_config=ADAPTERS["prompt-tuning"](), **cfg)
        if before is None:
            before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.model.load_state_dict(before)  # the adapter TRL's trainer drew
        with force_backend("chunked"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs.append(trainer)
    ref, ours = runs
    logs = [h for h in ref.state.log_history if "loss" in h]
    assert len(logs) == 3
    for want, got in zip(logs, [h for h in ours.state.log_history if "loss" in h]):
        for k in ("loss", "grad_norm", "entropy", "kl", "clip_ratio/region_mean"):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (k, want["step"])
    moved = 0.0
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)
        if "prompt_encoder" in name:
            moved = max(moved, (q - before[name]).abs().max().item())
    assert moved > 1e-4  # the virtual tokens were trained


def test_prompt_learning_is_found_behind_a_wrapper():
    """The layout is decided again on the first batch under ZeRO-3, on the model as TRL hands
    it (DeepSpeed's engine, whose .module is the PEFT model)."""
    import types

    from grpo_kernels.hf.unwrap import prompt_learning_adapter
    from grpo_train.tiny import build_tiny_model, build_tokenizer

    def wrapped(config):
        model = build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=1)
        return peft.get_peft_model(model, config)

    model = wrapped(ADAPTERS["prompt-tuning"]())
    assert prompt_learning_adapter(model) == "PromptTuningConfig"
    assert prompt_learning_adapter(types.SimpleNamespace(module=model)) == "PromptTuningConfig"
    lora = wrapped(ADAPTERS["lora-embedding"]())
    assert prompt_learning_adapter(types.SimpleNamespace(module=lora)) is None
    assert prompt_learning_adapter(lora.get_base_model()) is None
