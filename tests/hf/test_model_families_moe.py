"""grpo_kernels.hf on Gemma 4, Gemma 3n, DeepSeek V2 and V3 and DBRX: log-probs and entropies
against a float64 run of the model's own forward, the loss's gradients against its float32
logits (`test_model_families_more`), and the packed and shared rows `choose_layout` picks
against the padded batch given its positions (`test_model_families`).

Gemma 4: a config whose head_dim varies by layer (reading it from the whole config raises) and
a MoE block. Gemma 3n: per-layer token embeddings beside the body's input, AltUp and LAuReL
blocks. Both: sliding-window layers, a final-logit soft cap. DeepSeek V2 and V3: multi-head
latent attention (low-rank queries and keys/values, a rotary part of each head) and a
Mixture-of-Experts with shared experts after a first dense layer (V3 routes by sigmoid scores
with a bias). DBRX: a fused QKV projection clipped to clip_qkv and a Mixture-of-Experts of its
own, whose auxiliary loss the helpers reproduce.

And two layers that look linear and are not: a head with a learned logit scale of its own
(Dory), refused; Llama 4's router, left out of add_lora's "all-linear", which names Gemma 3n's
linear layers in a ModuleList so that its decoder layers are not taken too.
"""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_model_families as base  # noqa: E402
import test_model_families_more as more  # noqa: E402
from test_model_families import assert_same_loss  # noqa: E402

from grpo_kernels import FusedLinearGRPOLoss, force_backend, reference  # noqa: E402
from grpo_kernels.hf import (  # noqa: E402
    RowLayout,
    causal_lm_grpo_loss,
    check_output_head,
    choose_layout,
    completion_logprobs,
    plan_rows,
    row_inputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V = more.V
TEXT = more.TEXT
_MLA = dict(TEXT, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
            topk_group=1)
# family -> (config class, model class, config keywords)
FAMILIES = {
    "gemma3n-softcap": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                        dict(TEXT, head_dim=8, hidden_size_per_layer_input=8,
                             vocab_size_per_layer_input=V, laurel_rank=4, altup_num_inputs=2,
                             num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0],
                             layer_types=["sliding_attention", "full_attention"],
                             sliding_window=4, intermediate_size=[64, 64],
                             final_logit_softcapping=0.5,
                             # no zero padding embedding: the model's own gradient is NaN
                             # wherever a token's first hidden state is 0 (AltUp's RMS
                             # magnitude, mean(h²) ** 0.5, has an infinite derivative there)
                             pad_token_id=None)),
    "gemma4-moe-softcap": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                           dict(TEXT, head_dim=8, global_head_dim=16, sliding_window=4,
                                layer_types=["sliding_attention", "full_attention"],
                                vocab_size_per_layer_input=V, hidden_size_per_layer_input=8,
                                enable_moe_block=True, num_experts=4, top_k_experts=2,
                                moe_intermediate_size=32, final_logit_softcapping=0.5,
                                pad_token_id=None)),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _MLA),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _MLA),
    # rope_theta in the attention config (transformers 5.24 reads it there, and its default
    # config lacks it) and a clip_qkv (its forward clamps with clip_qkv, None fails)
    "dbrx": ("DbrxConfig", "DbrxForCausalLM",
             dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                  attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                  ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
                  pad_token_id=0)),
}
# the layout choose_layout gives each (grpo_train's padded forward passes position_ids)
LAYOUT = {"gemma3n-softcap": RowLayout.PACKED, "gemma4-moe-softcap": RowLayout.PACKED,
          "deepseek-v2": RowLayout.SHARED, "deepseek-v3": RowLayout.SHARED,
          "dbrx": RowLayout.SHARED}
HP = dict(beta=0.04, temperature=0.7)


def build(family):
    more.FAMILIES.setdefault(family, FAMILIES[family])
    return more.build(family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_batch_matches_the_models_own(family):
    build(family)  # registers the family with test_model_families_more
    more.test_logprobs_entropy_and_gradients_match_the_models_own(family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chosen_rows_match_the_padded_batch(family):
    """The layout choose_layout picks (its reason a phrase) gives the padded batch's log-probs,
    loss and gradients given position_ids = cumsum(mask) - 1."""
    model = build(family)
    choice = choose_layout(model)
    assert choice.layout is LAYOUT[family], choice
    b = base.make_batch()
    T, ids, am = b["T"], b["ids"], b["am"]
    rows = plan_rows(ids, am, T, b["cm"], choice.layout, model_config=model.config)
    kwargs = row_inputs(rows, model.config)
    positions = (am.cumsum(1) - 1).clamp(min=0)
    with force_backend("chunked"):
        got = completion_logprobs(model, rows.input_ids, rows.attention_mask,
                                  rows.logits_to_keep, temperature=0.7, **kwargs).detach()
        with torch.no_grad():
            want = reference.logprobs_from_logits(base.own(model, b, positions), ids[:, -T:],
                                                  temperature=0.7)
        torch.testing.assert_close(got, rows.pack(want), rtol=1e-4, atol=1e-4)
        assert_same_loss(
            model,
            lambda: causal_lm_grpo_loss(model, rows.input_ids, rows.attention_mask,
                                        rows.logits_to_keep, b["adv"], None,
                                        rows.pack(b["old"]), rows.pack(b["ref"]),
                                        cu_seqlens=rows.cu_seqlens,
                                        loss_fn=FusedLinearGRPOLoss(**HP), **kwargs)[0],
            lambda: reference.grpo_loss(base.own(model, b, positions), ids[:, -T:], b["adv"],
                                        b["cm"], b["old"], b["ref"], **HP)[0])


def test_dbrx_auxiliary_loss_is_its_own_on_padded_and_packed_rows():
    """DBRX's modeling module has Mixtral's load_balancing_loss_func: the bound loss, on the
    body's router logits of the padded batch and of its packed rows (their real-token mask),
    equals the aux_loss of DBRX's own forward."""
    from grpo_kernels.hf import completion_hidden_states, load_balancing_loss, pack_sequences

    model, b = build("dbrx"), base.make_batch()
    T, ids, am = b["T"], b["ids"], b["am"]
    aux = load_balancing_loss(model)
    rows = pack_sequences(ids, am, T, b["cm"], model_config=model.config)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am, output_router_logits=True,
                     use_cache=False).aux_loss
        _, padded = completion_hidden_states(model, ids, am, T, return_router_logits=True)
        _, packed = completion_hidden_states(model, rows.input_ids, None, rows.logits_to_keep,
                                             position_ids=rows.position_ids,
                                             return_router_logits=True)
    torch.testing.assert_close(aux(padded, am), want)
    torch.testing.assert_close(aux(packed, rows.real_mask()), want)


def test_head_with_a_logit_scale_of_its_own_is_refused():
    """Dory's head multiplies its output by a learned per-token scale, exactly 1 when the model
    is built: the logits check alone passes then, and would pass on a trained checkpoint only
    if the scale stayed 1. The head is refused for the parameter, naming it."""
    if not hasattr(transformers, "DoryForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Dory")
    torch.manual_seed(0)
    model = transformers.DoryForCausalLM(transformers.DoryConfig(**dict(TEXT, head_dim=8)))
    with torch.no_grad():  # a trained scale
        model.lm_head.logit_scale.normal_(0.02, 0.005)
    with pytest.raises(NotImplementedError, match=r"DoryForCausalLM.lm_head \(DoryLMHead\) has "
                                                  r"parameters of its own.*logit_scale"):
        check_output_head(model)


@pytest.mark.parametrize("family", ["llama4-text", "gemma3n-softcap"])
def test_add_lora_all_linear_takes_every_linear_map(family, caplog):
    """add_lora's "all-linear" puts LoRA on every linear layer but the head's own and
    those that are not a linear map: Llama 4's router, an nn.Linear whose forward returns
    (scores, logits), on which LoRA (PEFT adds its update to the base layer's output) fails in
    the model's own forward, is left out with a warning naming it. Gemma 3n's
    altup_projections are an nn.ModuleList, "0" and "1": named so, PEFT would also take the
    decoder layers "layers.0" and "layers.1" and refuse them. The fused log-probs equal the
    wrapped model's."""
    pytest.importorskip("peft")
    from torch import nn

    from grpo_kernels.hf import add_lora

    model = base.build(family) if family in base.FAMILIES else build(family)
    routers = {n for n, m in model.named_modules() if type(m).__name__ == "Llama4Router"}
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)} - routers
    with caplog.at_level(logging.WARNING, logger="grpo_kernels.hf.head_adapters"):
        model = add_lora(model, r=4, alpha=8)
    warned = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert warned == ([f"add_lora: all-linear leaves out {len(routers)} Llama4Router layers "
                       "(has a forward of its own whose output (tuple) is not x·Wᵀ + b)"]
                      if routers else []), warned
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules()
               if hasattr(m, "lora_A")}
    assert wrapped == linear
    with torch.no_grad():  # B = 0 at initialization: give the adapters an effect
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    b = base.make_batch()
    T, ids, cm = b["T"], b["ids"], b["cm"]
    with force_backend("chunked"):
        got = completion_logprobs(model, ids, b["am"], T).detach()
        with torch.no_grad():
            want = reference.logprobs_from_logits(base.own(model, b), ids[:, -T:])
    torch.testing.assert_close(got * cm, want * cm, rtol=1e-4, atol=1e-4)
