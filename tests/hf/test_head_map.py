"""An output embedding that is not an nn.Linear: the fused path projects with its weight and
bias, so it must compute x·Wᵀ + b; one that computes something else is refused, naming it, and
one that computes exactly that runs and gives the model's own log-probs."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from grpo_kernels.hf import causal_lm_logprobs, check_output_head  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

T = 4  # completion length


class Head(nn.Module):
    """A custom output embedding holding the model's head weight; `scale` multiplies its
    product (1: the plain linear map)."""

    def __init__(self, linear: nn.Linear, scale: float):
        super().__init__()
        self.weight, self.bias, self.scale = linear.weight, None, scale

    def forward(self, x):
        return nn.functional.linear(x, self.weight) * self.scale


def model_with_head(scale: float) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).eval()
    model.set_output_embeddings(Head(model.lm_head, scale))
    return model


def test_a_head_that_is_not_its_linear_map_is_refused():
    """Its logits are the head's output, so the logits check passed, and the log-probs were
    those of hidden @ weight.T: off by 0.19 here."""
    model = model_with_head(2.0)
    with pytest.raises(NotImplementedError, match=r"lm_head \(Head\).*not x·Wᵀ \+ b"):
        check_output_head(model)


def test_a_head_that_is_its_linear_map_runs():
    model = model_with_head(1.0)
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -T - 1:-1].float()
    want = logits.log_softmax(-1).gather(-1, ids[:, -T:, None])[..., 0]
    torch.testing.assert_close(causal_lm_logprobs(model, ids, torch.ones_like(ids), T), want)


def test_the_probe_runs_once_over_repeated_fused_calls(monkeypatch):
    """The head's linear-map probe (a forward and a host read) runs on the first fused call
    and is kept while the head is unchanged (hf/head_probe.py)."""
    from grpo_kernels.hf import head_probe

    runs = []
    probe = head_probe._run_probe
    monkeypatch.setattr(head_probe, "_run_probe", lambda *a: runs.append(1) or probe(*a))
    model = model_with_head(1.0)
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    first = causal_lm_logprobs(model, ids, torch.ones_like(ids), T)
    for _ in range(3):
        torch.testing.assert_close(causal_lm_logprobs(model, ids, torch.ones_like(ids), T), first)
    assert len(runs) == 1
    model.lm_head.scale = 2.0  # no longer x·Wᵀ: probed again, and refused
    with pytest.raises(NotImplementedError, match="not x·Wᵀ"):
        causal_lm_logprobs(model, ids, torch.ones_like(ids), T)
    assert len(runs) == 2
