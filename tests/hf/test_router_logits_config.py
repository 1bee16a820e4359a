"""A Mixture-of-Experts config that asks for router logits (`output_router_logits: true`, as
checkpoints trained with the load-balancing loss are saved): the model's own forward then adds
that loss with the attention mask it is given, which cannot read a shared-prefix row's 4-D mask
(transformers' Mixtral: 'The size of tensor a (16) must match the size of tensor b (256)').
The fused path runs the body, which computes no loss; the helpers' full-model forwards on
shared rows (the layout check, grpo_train's materialized-logits reference) ask for no router
logits, so such a model shares prompts as the same model saved without the flag does."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from grpo_kernels import reference  # noqa: E402
from grpo_kernels.hf import (  # noqa: E402
    RowLayout,
    check_shared_prompt,
    choose_layout,
    completion_logprobs,
    router_logits_off,
    share_prompts,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_mixtral(output_router_logits: bool):
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None, router_aux_loss_coef=0.02,
        output_router_logits=output_router_logits, attn_implementation="sdpa")).eval()


def test_config_asking_for_router_logits_still_shares_prompts():
    model = tiny_mixtral(output_router_logits=True)
    assert check_shared_prompt(model) is None
    assert choose_layout(model).layout is RowLayout.SHARED
    # the aux loss added over the rows still refuses sharing (each prompt counted once)
    assert choose_layout(model, aux_loss=True).layout is RowLayout.PACKED


def test_shared_rows_of_such_a_model_give_its_padded_log_probs():
    """The fused log-probs of shared rows, and the model's own logits on those rows (its
    forward with `router_logits_off`), equal its own logits on the padded batch."""
    model = tiny_mixtral(output_router_logits=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 97, (3, 10), generator=g)
    ids[1, :5] = ids[0, :5]  # sequences 0 and 1 share a 5-token prompt
    am = torch.ones_like(ids)
    am[2, :2] = 0  # a left-padded prompt
    am[0, -2:] = 0  # a shorter completion
    T = 5
    rows = share_prompts(ids, am, T, am[:, -T:], model_config=model.config)
    with torch.no_grad():
        positions = (am.cumsum(1) - 1).clamp(min=0)
        want = reference.logprobs_from_logits(
            model(input_ids=ids, attention_mask=am, position_ids=positions,
                  use_cache=False).logits[:, -T - 1:-1], ids[:, -T:])
        got = completion_logprobs(model, rows.input_ids, rows.attention_mask,
                                  rows.logits_to_keep, position_ids=rows.position_ids)
        own = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                    position_ids=rows.position_ids, use_cache=False,
                    **router_logits_off(model)).logits
    own = reference.logprobs_from_logits(own.reshape(-1, own.shape[-1])[rows.logits_to_keep],
                                         rows.input_ids.reshape(-1)[rows.logits_to_keep + 1])
    torch.testing.assert_close(got, rows.pack(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(own, rows.pack(want), rtol=1e-5, atol=1e-5)


def test_router_logits_off_only_where_the_config_asks_for_them():
    assert router_logits_off(tiny_mixtral(output_router_logits=True)) == {
        "output_router_logits": False}
    assert router_logits_off(tiny_mixtral(output_router_logits=False)) == {}
    assert router_logits_off(torch.nn.Linear(2, 2)) == {}  # no config: nothing to turn off


def test_a_wrapped_model_runs_shared_rows():
    """A wrapper (DDP, accelerate, PEFT) runs the whole model, whose forward would add the aux
    loss over the shared rows' 4-D mask: the helpers call it with `router_logits_off`, and its
    log-probs equal the bare model's."""
    model = tiny_mixtral(output_router_logits=True)
    wrapped = torch.nn.Module()  # a DDP-style `.module` wrapper
    wrapped.module = model
    wrapped.forward = lambda **kw: model(**kw)
    ids = torch.randint(2, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    ids[1, :5] = ids[0, :5]
    am = torch.ones_like(ids)
    rows = share_prompts(ids, am, 5, am[:, -5:], model_config=model.config)
    args = (rows.input_ids, rows.attention_mask, rows.logits_to_keep)
    with torch.no_grad():
        bare = completion_logprobs(model, *args, position_ids=rows.position_ids)
        through = completion_logprobs(wrapped, *args, position_ids=rows.position_ids)
    torch.testing.assert_close(through, bare, rtol=0, atol=0)
