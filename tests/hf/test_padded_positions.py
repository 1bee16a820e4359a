"""`check_padded_positions`: a left-padded forward without position_ids against packed rows'
positions. GPT-2's learned absolute position embeddings are refused, in float32 and bf16; rotary
models (Qwen2, Llama) and OPT, which counts positions from the attention mask, are allowed; a
forward that takes no position_ids is refused. `choose_layout` asks for the check only where the
caller's padded forward passes no position_ids (the TRL subclass), so grpo_train still packs
GPT-2."""

import types

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from grpo_kernels.hf import RowLayout, check_padded_positions, choose_layout

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SIZES = dict(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def tiny(arch: str, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=64, bos_token_id=1, eos_token_id=1))
    elif arch == "opt":
        model = OPTForCausalLM(OPTConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, ffn_dim=64,
                                         max_position_embeddings=64, word_embed_proj_dim=32))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SIZES))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch, allowed", [("gpt2", False), ("opt", True), ("qwen2", True),
                                           ("llama", True)])
def test_absolute_positions_are_refused_relative_ones_allowed(arch, allowed, dtype):
    model = tiny(arch, dtype).train()
    reason = check_padded_positions(model)
    if allowed:
        assert reason is None
    else:
        assert reason.startswith("GPT2LMHeadModel reads other positions in a left-padded "
                                 "forward without position_ids than in packed rows")
    assert model.training  # put back as it was (the check runs in eval: no dropout)


def test_checked_once_per_model():
    model = tiny("gpt2")
    calls = []
    model.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    first = check_padded_positions(model)
    assert first is not None and len(calls) == 2  # padded, then as packed rows run it
    assert check_padded_positions(model) == first and len(calls) == 2


class NoPositions(nn.Module):
    """A causal LM whose forward takes no position_ids."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=11, _attn_implementation="eager")
        self.emb = nn.Embedding(11, 4)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return types.SimpleNamespace(logits=self.emb(input_ids))


def test_a_forward_without_position_ids_is_refused():
    reason = check_padded_positions(NoPositions())
    assert reason.startswith("NoPositions failed on a padded sequence or on position_ids: "
                             "TypeError")


def test_choose_layout_checks_positions_only_without_padded_position_ids():
    gpt2 = tiny("gpt2")
    trl_like = choose_layout(gpt2, padded_position_ids=False)
    assert trl_like.layout is RowLayout.PADDED
    assert trl_like.reason.startswith("not packed: GPT2LMHeadModel reads other positions")
    # grpo_train's padded forward passes cumsum(mask) - 1: packed rows give the same positions
    assert choose_layout(gpt2).layout is RowLayout.SHARED
    assert choose_layout(tiny("qwen2"), padded_position_ids=False).layout is RowLayout.SHARED
    assert choose_layout(tiny("llama"), padded_position_ids=False,
                         share_prompt=False).layout is RowLayout.PACKED


def test_shared_rows_do_not_need_packed_rows():
    """OPT mixes the sequences of a packed row (its positions come from the 2-D mask), so
    packed rows are refused; shared rows carry their own 4-D mask and position_ids, and their
    check passes: the layout is shared, the log reason names the refused packed rows. Its
    shared log-probs equal the padded ones."""
    from transformers import OPTConfig, OPTForCausalLM

    from grpo_kernels.hf import completion_logprobs, plan_rows, row_inputs

    torch.manual_seed(0)
    opt = OPTForCausalLM(OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
                                   max_position_embeddings=64, dropout=0.0)).eval()
    choice = choose_layout(opt)
    assert choice.layout is RowLayout.SHARED
    assert "packed rows refused" in choice.reason
    assert choose_layout(opt, share_prompt=False).layout is RowLayout.PADDED
    T = 3
    ids = torch.randint(4, 96, (4, 8))
    ids[1, :5] = ids[0, :5]  # one group: rows 0 and 1 share their 5-token prompt
    ids[3, :5] = ids[2, :5]
    am = torch.ones_like(ids)
    am[2:, :1] = 0  # the second group's prompt is left-padded
    ids[2:, :1] = 1
    am[1, -1] = 0  # a completion one token short
    with torch.no_grad():
        padded = completion_logprobs(opt, ids, am, T)
        rows = plan_rows(ids, am, T, am[:, -T:], RowLayout.SHARED, model_config=opt.config)
        shared = completion_logprobs(opt, rows.input_ids, rows.attention_mask,
                                     rows.logits_to_keep, **row_inputs(rows, opt.config))
    torch.testing.assert_close(shared, padded[am[:, -T:].bool()], rtol=1e-5, atol=1e-5)


def test_alibi_models_are_refused_shared_rows_with_the_reason():
    """Bloom and Falcon with ALiBi build their position biases from a 2-D mask: shared rows are
    refused from the config, with that reason (not the model's own unpacking error)."""
    from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM

    from grpo_kernels.hf.shared_prompt import check_shared_prompt

    bloom = BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=100))
    falcon = FalconForCausalLM(FalconConfig(hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, vocab_size=100, alibi=True))
    for model in (bloom, falcon):
        assert "ALiBi" in check_shared_prompt(model)


@pytest.mark.gpu
def test_right_padded_prompts_on_cuda_are_a_device_check():
    """On CUDA the padding-side check of padded rows reads nothing on the host (no sync per
    call): the call's log-probs come out NaN and the next call, or a wait for the device
    checks, raises."""
    from grpo_kernels import value_checks
    from grpo_kernels.hf import completion_logprobs

    model, T = tiny("llama").cuda(), 3
    ids = torch.randint(2, 60, (2, 9), device="cuda")
    am = torch.ones_like(ids)
    am[0, -T - 2:-T] = 0  # row 0's prompt padded on the right
    logp = completion_logprobs(model, ids, am, T)
    assert torch.isnan(logp).all()
    with pytest.raises(ValueError, match="pad prompts on the left"):
        value_checks.raise_ready(wait=True)
