"""The TRL subclass takes the attention rule's choice (`ModelSupport`, scoped=False: sdpa or
eager, set for the whole model since TRL generates with it too), checked to give the model's
own logits, and says it on the attention logger; TRL's own implementation keeps the model's."""

import logging

import torch

from grpo_kernels.hf import attention_choice
from grpo_kernels.trl import GRPOTrainer
from tests.trl_harness import make_batch, make_trainer


def test_eager_model_is_switched_to_the_rules_sdpa_with_one_line(model_dir, caplog):
    attention_choice._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="grpo_kernels.hf.attention"):
        tr = make_trainer(GRPOTrainer, model_dir,
                          model_init_kwargs={"attn_implementation": "eager"})
    choice = tr._support.attention
    assert choice.implementation == "sdpa" and choice.layout == "shared"
    assert tr.model.config._attn_implementation == "sdpa"
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_kernels.hf.attention"]
    assert lines == ["grpo_kernels: attention sdpa for shared rows on cpu: rule cpu/shared: "
                     "sdpa, eager (measured)"]
    with torch.no_grad():  # the loss runs on the switched model
        loss = tr._compute_loss(tr.model, make_batch(tr))
    assert torch.isfinite(loss)


def test_trls_own_implementation_keeps_the_models_attention(monkeypatch):
    """Where TRL's own implementation runs (here: a head the fused path refuses), the model
    keeps its attention: TRL's forwards are TRL's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_kernels.trl import model_support

    def refuse(model):
        raise ValueError("an output head the fused path does not take")

    monkeypatch.setattr(model_support, "check_output_head", refuse)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, attn_implementation="eager"))
    support = model_support.ModelSupport(model, aux_loss_enabled=False, padding_free=True,
                                         share_prompt=True)
    assert support.fallback == "an output head the fused path does not take"
    assert support.attention is None and support.layout == "padded"
    assert model.config._attn_implementation == "eager"
