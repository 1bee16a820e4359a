"""benchmarks.shared_prompt: every layout of one micro-batch gives the same loss, and the counts
it reports are the layouts' (shared < packed < padded positions at a long prompt)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks import shared_prompt
from grpo_kernels import FusedLinearGRPOLoss
from grpo_kernels.hf import RowLayout

pytestmark = pytest.mark.usefixtures("one_thread")


def test_layouts_agree_and_shared_computes_fewer_positions():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=211, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).train()
    batch = shared_prompt.synthetic_batch(groups=2, G=4, prompt=48, cap=32, vocab=211, seed=0)
    assert torch.equal(batch["input_ids"][0, :48], batch["input_ids"][3, :48])
    assert not torch.equal(batch["input_ids"][0, :48], batch["input_ids"][4, :48])
    fn = FusedLinearGRPOLoss(beta=0.04)
    got = {layout: shared_prompt.run_layout(model, batch, layout, fn, "cpu")
           for layout in RowLayout}
    assert got["shared"]["loss"] == pytest.approx(got["padded"]["loss"], rel=1e-5, abs=1e-7)
    assert got["packed"]["loss"] == pytest.approx(got["padded"]["loss"], rel=1e-5, abs=1e-7)
    real = int(batch["attention_mask"].sum())
    assert got["shared"]["body_positions"] < real <= got["packed"]["body_positions"]
    assert got["packed"]["body_positions"] <= got["padded"]["body_positions"]
    assert got["shared"]["head_positions"] == int(batch["completion_mask"].sum())
    assert all(r["loss_rise_bytes"] > 0 for r in got.values())
