"""grpo_train's head options: LoRA (--lora_r, adapters on every linear layer and the output head,
trained by the fused loss) and a float32 output head under bf16 (--fp32_lm_head)."""

import dataclasses

import pytest
import torch
from test_train_loop import tiny_cfg

from grpo_train import parse_config, train
from grpo_train.checks import validate
from grpo_train.flags import UsageError

pytest.importorskip("peft")


def _policy_state(tmp_path, **overrides):
    """(state before any RL step, state after two steps) of the trained model's parameters."""
    before = train(tiny_cfg(tmp_path / "before", steps=0, **overrides))["model"]
    start = {k: v.detach().clone() for k, v in before.named_parameters()}
    after = train(tiny_cfg(tmp_path / "after", **overrides))["model"]
    return start, {k: v.detach().clone() for k, v in after.named_parameters()}


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_lora_trains_only_the_adapters_including_the_head(tmp_path, backend):
    start, end = _policy_state(tmp_path, lora_r=4, backend=backend)
    moved = {k for k in start if not torch.equal(start[k], end[k])}
    assert moved, "nothing trained"
    assert all("lora_" in k for k in moved), sorted(moved)[:5]  # base weights stay frozen
    # the output head's adapter is among the trained ones (not silently ignored)
    assert any("lm_head.lora_B" in k for k in moved), sorted(moved)


def test_lora_without_head_adapter_leaves_the_head_alone(tmp_path):
    start, end = _policy_state(tmp_path, lora_r=4, lora_head=False)
    moved = {k for k in start if not torch.equal(start[k], end[k])}
    assert moved and not any("lm_head" in k for k in moved), sorted(moved)


def test_lora_init_follows_the_seed(tmp_path):
    """The adapters' random init is a function of --seed: two runs with the same settings start
    from the same adapters whatever the process drew before them."""
    starts = []
    for draw in (1, 2):
        torch.manual_seed(draw)  # the process' generator as earlier work left it
        model = train(tiny_cfg(tmp_path / str(draw), steps=0, lora_r=4))["model"]
        starts.append({k: v.detach().clone() for k, v in model.named_parameters()
                       if "lora_A" in k})
    assert starts[0] and starts[0].keys() == starts[1].keys()
    assert all(torch.equal(starts[0][k], starts[1][k]) for k in starts[0])


def test_fp32_head_under_bf16_autocast_trains(tmp_path):
    result = train(tiny_cfg(tmp_path, fp32_lm_head=True, bf16=True, backend="triton"))
    head = result["model"].get_output_embeddings()
    assert head.weight.dtype == torch.float32


def test_head_option_errors_name_the_flag(tmp_path):
    with pytest.raises(UsageError, match="--lora_dropout"):
        parse_config(["--lora_r", "4", "--lora_dropout", "1.5"])
    with pytest.raises(UsageError, match="--lora_r"):
        parse_config(["--lora_r", "-1"])
    with pytest.raises(UsageError, match="--fp32_lm_head"):
        parse_config(["--lora_r", "4", "--fp32_lm_head"])
    cfg = dataclasses.replace(tiny_cfg(tmp_path), fsdp=True, lora_r=4)
    with pytest.raises(UsageError, match="--fsdp"):
        validate(cfg)
    # a tied head cannot become float32 alone in a pure-bf16 model
    with pytest.raises(UsageError, match="ties its output head"):
        train(tiny_cfg(tmp_path, fp32_lm_head=True, model_dtype="bfloat16"))


def test_lora_reference_is_the_policy_without_adapters(tmp_path, monkeypatch):
    """With --lora_r and beta > 0 the reference policy is the policy with its adapters disabled:
    no copy of the model is made, and its log-probs are those of the initial (base) model."""
    import copy

    import transformers

    from grpo_kernels.hf import add_lora, causal_lm_logprobs
    from grpo_train import models, trainer
    from grpo_train.tiny import build_tiny_model, build_tokenizer

    copied = []
    real_deepcopy = copy.deepcopy

    def watch(x, *args, **kwargs):
        if isinstance(x, transformers.PreTrainedModel):
            copied.append(type(x).__name__)
        return real_deepcopy(x, *args, **kwargs)

    monkeypatch.setattr(models.copy, "deepcopy", watch)
    train(tiny_cfg(tmp_path / "lora", lora_r=4, beta=0.1, steps=1))
    assert copied == [], copied
    train(tiny_cfg(tmp_path / "full", beta=0.1, steps=0))
    assert copied == ["Qwen2ForCausalLM"]  # without LoRA the frozen copy is still made
    monkeypatch.undo()

    torch.manual_seed(0)
    tok = build_tokenizer()
    base = build_tiny_model(tok, hidden_size=32).eval()
    policy = add_lora(copy.deepcopy(base), r=4)
    with torch.no_grad():  # adapters away from their zero start, as after training
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    policy.train()
    ids = torch.randint(3, len(tok), (3, 9))
    want = causal_lm_logprobs(base, ids, None, 4)
    with trainer._reference_policy(policy, None) as reference:
        got = causal_lm_logprobs(reference, ids, None, 4)
    assert policy.training  # restored
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (causal_lm_logprobs(policy, ids, None, 4) - want).abs().max() > 1e-3  # adapters act
