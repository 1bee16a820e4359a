"""State kept per model or per process, against a model changed after its first call: the
once-per-model checks must not give the answer of the model as it was (a silent wrong
log-prob), and the checks must not move the caller's random stream."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from grpo_kernels.hf import (  # noqa: E402
    attention_choice,
    causal_lm_logprobs,
    choose_attention,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

T = 4  # completion length


def tiny_qwen(seed: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(cfg).eval()


def batch():
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def own_logprobs(model, ids) -> torch.Tensor:
    """[B, T] log-probs of the last T tokens from the model's own logits."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -T - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, -T:, None])[..., 0]


def test_a_body_replaced_after_the_first_call_is_the_one_that_runs():
    """model.model = another body (a swapped or re-loaded transformer) after a first call: the
    cached check held the old body, whose states the next calls projected."""
    model, other = tiny_qwen(0), tiny_qwen(1)
    ids, mask = batch()
    torch.testing.assert_close(causal_lm_logprobs(model, ids, mask, T), own_logprobs(model, ids))
    model.model = other.model
    want = own_logprobs(model, ids)
    assert not torch.allclose(want, own_logprobs(tiny_qwen(0), ids))  # the swap shows
    torch.testing.assert_close(causal_lm_logprobs(model, ids, mask, T), want)


def test_a_logit_transform_named_after_the_first_call_is_checked():
    """A config that names a transform its model does not apply is refused, also when it is
    set after the model's first call (the transform is read per call; the check was not)."""
    model = tiny_qwen(0)
    ids, mask = batch()
    causal_lm_logprobs(model, ids, mask, T)
    model.config.logits_scaling = 4.0
    with pytest.raises(NotImplementedError, match="logits are not those"):
        causal_lm_logprobs(model, ids, mask, T)
    del model.config.logits_scaling
    torch.testing.assert_close(causal_lm_logprobs(model, ids, mask, T), own_logprobs(model, ids))


def test_a_head_replaced_after_the_first_call_is_checked():
    """A new output embedding whose input is not the body's output (here a pre-hook rescales
    it) is refused after a first call too, as it is on a first call."""
    model = tiny_qwen(0)
    ids, mask = batch()
    causal_lm_logprobs(model, ids, mask, T)
    head = torch.nn.Linear(64, 50, bias=False)
    head.register_forward_pre_hook(lambda _m, args: (args[0] * 2,))
    model.set_output_embeddings(head)
    with pytest.raises(NotImplementedError, match="directly to the output of its body"):
        causal_lm_logprobs(model, ids, mask, T)


def test_the_flex_attention_probe_leaves_the_random_stream_alone(monkeypatch):
    """Whether flex attention runs here is found by running it once; its input must not be a
    draw from the caller's generator (asking for it moved the stream a user seeded)."""
    monkeypatch.setattr(attention_choice, "_FLEX", {})
    model = tiny_qwen(0)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="flex_attention"):  # no CPU backward
        choose_attention(model, "packed", requested="flex_attention")
    assert torch.equal(torch.get_rng_state(), state)


def test_a_layout_check_answers_for_the_bound_it_is_asked():
    """The layout checks were cached per implementation only: a first call with a loose `atol`
    answered every later call, and a model whose packed rows leak (OPT's own mask handling
    mixes the sequences of a packed row; GPT-2's absolute positions move without position_ids)
    was then said to pack exactly."""
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    from grpo_kernels.hf import check_packed_attention, check_padded_positions

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        opt = OPTForCausalLM(OPTConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1,
                                       ffn_dim=64, num_attention_heads=4,
                                       word_embed_proj_dim=32)).eval()
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=60, n_embd=32, n_layer=1, n_head=4)).eval()
    assert check_packed_attention(opt, atol=1e9) is None
    assert "attends across" in check_packed_attention(opt)
    assert check_padded_positions(gpt2, atol=1e9) is None
    assert "reads other positions" in check_padded_positions(gpt2)
