"""grpo_kernels.hf across causal-LM families: log-probs, loss and every parameter's gradient of
the hidden-state path equal those of the model's own logits (float32, TRL's GRPO loss from
`grpo_kernels.reference`), on a batch with left-padded prompts and right-padded completions, at
temperature 0.7; packed and shared-prefix rows equal the padded batch where the model allows
them (and say why not where it does not).

The families cover the unusual heads: tied embeddings (Qwen2, GPT-2), a biased head (Phi), a head
not called lm_head (GPT-NeoX's embed_out), a body run through its sub-model (OPT), final-logit
soft-capping (Gemma 2; RecurrentGemma's logits_soft_cap; xLSTM's output_logit_soft_cap, on a
head that runs on every position), a scale after the head (Cohere's logit_scale, Granite's
logits_scaling) and before it (MiniCPM3 divides the hidden states by logits_scaling), a
Mixture-of-Experts body (Qwen3-MoE, Llama 4, whose base_model is not its body) and
transformers' Conv1D layers (GPT-2).
"""

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from grpo_kernels import FusedLinearGRPOLoss, force_backend, reference  # noqa: E402
from grpo_kernels.hf import (  # noqa: E402
    causal_lm_grpo_loss,
    check_output_head,
    check_packed_attention,
    check_shared_prompt,
    completion_logprobs,
    logit_transform,
    pack_sequences,
    share_prompts,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V = 96
_COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=0)
# family -> (config class, model class, config keywords)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _COMMON),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, tie_word_embeddings=True)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32)),
    "gemma2-softcap": ("Gemma2Config", "Gemma2ForCausalLM",
                       dict(_COMMON, head_dim=8, final_logit_softcapping=0.5, sliding_window=4)),
    "recurrent-gemma-softcap": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
                                dict(_COMMON, num_hidden_layers=3, lru_width=32,
                                     attention_window_size=16, logits_soft_cap=0.5)),
    "cohere-scale": ("CohereConfig", "CohereForCausalLM", dict(_COMMON, logit_scale=0.25)),
    "granite-logits-scaling": ("GraniteConfig", "GraniteForCausalLM",
                               dict(_COMMON, logits_scaling=4.0, embedding_multiplier=2.0,
                                    residual_multiplier=0.5, attention_multiplier=0.3)),
    "minicpm3-prescaled": ("MiniCPM3Config", "MiniCPM3ForCausalLM",
                           dict(_COMMON, hidden_size=40, num_key_value_heads=4,
                                dim_model_base=16, q_lora_rank=16, kv_lora_rank=16,
                                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
    # base_model_prefix "language_model" names no attribute: the body is its child `model`
    "llama4-text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    dict(_COMMON, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                         intermediate_size_mlp=64, interleave_moe_layer_step=1,
                         no_rope_layers=[1, 1])),
    # divides the hidden states by logits_mup_width_multiplier before its head
    "inkling-prescaled": ("InklingTextConfig", "InklingForCausalLM",
                          dict(_COMMON, logits_mup_width_multiplier=4.0, head_dim=8,
                               swa_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
                               num_experts_per_tok=2, rel_extent=16)),
    "phi-bias": ("PhiConfig", "PhiForCausalLM", _COMMON),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0)),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _COMMON),
    # no logits_to_keep (the head runs on every position), output_logit_soft_cap
    "xlstm-softcap": ("xLSTMConfig", "xLSTMForCausalLM",
                      dict(vocab_size=V, hidden_size=32, embedding_dim=32, num_hidden_layers=2,
                           num_blocks=2, num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0,
                           chunk_size=1, output_logit_soft_cap=0.5, pad_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                 pad_token_id=1)),
}
HP = dict(beta=0.04, temperature=0.7)


def build(family: str) -> nn.Module:
    config_cls, model_cls, kwargs = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    with torch.no_grad():  # logits of a few units (random weights give tenths): caps bend them
        model.get_output_embeddings().weight.mul_(8.0)
    return model.float().eval()


def make_batch():
    """4 sequences [4, 11], the last T = 5 columns the completion; sequences 0 and 1 share a
    prompt; left-padded prompts (2, 3), right-padded completions (1, 3)."""
    g = torch.Generator().manual_seed(1)
    S, T = 4, 5
    ids = torch.randint(2, V, (S, 11), generator=g)
    ids[1, :-T] = ids[0, :-T]
    am = torch.ones_like(ids)
    am[2, :2] = am[3, :1] = am[1, -2:] = am[3, -1:] = 0
    ids[am == 0] = 0
    old, ref = (torch.randn(S, T, generator=g) * 0.1 - 4.0 for _ in range(2))
    return dict(ids=ids, am=am, T=T, cm=am[:, -T:].clone(), adv=torch.randn(S, generator=g),
                old=old, ref=ref)


def own(model, b, position_ids=None):
    """The model's own logits of the completion positions [S, T, V] float32 (with grad)."""
    kwargs = {} if position_ids is None else dict(position_ids=position_ids)
    logits = model(input_ids=b["ids"], attention_mask=b["am"], use_cache=False, **kwargs).logits
    return logits.float()[:, -b["T"] - 1:-1]


def loss_and_grads(model, compute):
    model.zero_grad()
    loss = compute()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def assert_same_loss(model, fused, eager):
    """The fused and eager losses and every parameter's gradient agree; returns the fused
    gradients."""
    loss, grads = loss_and_grads(model, fused)
    want, want_grads = loss_and_grads(model, eager)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():  # to float32 rounding of the largest entry (sums of V terms)
        err = (g - want_grads[name]).abs().max().item()
        assert err <= 1e-4 * max(1.0, want_grads[name].abs().max().item()), (name, err)
    return grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_batch_matches_model_logits(family):
    model, b = build(family), make_batch()
    T, ids, cm = b["T"], b["ids"], b["cm"]
    with force_backend("chunked"):
        check_output_head(model)
        got = completion_logprobs(model, ids, b["am"], T, temperature=0.7).detach()
        with torch.no_grad():
            want = reference.logprobs_from_logits(own(model, b), ids[:, -T:], temperature=0.7)
        torch.testing.assert_close(got * cm, want * cm, rtol=1e-4, atol=1e-4)
        assert_same_loss(
            model,
            lambda: causal_lm_grpo_loss(model, ids, b["am"], T, b["adv"], cm, b["old"], b["ref"],
                                        loss_fn=FusedLinearGRPOLoss(**HP))[0],
            lambda: reference.grpo_loss(own(model, b), ids[:, -T:], b["adv"], cm, b["old"],
                                        b["ref"], **HP)[0])


@pytest.mark.parametrize("family", ["llama", "gemma2-softcap", "minicpm3-prescaled", "gpt2",
                                    "opt", "qwen3-moe"])
@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_rows_match_padded_batch_or_say_why_not(family, layout):
    """Packed / shared rows equal the padded batch given position_ids = cumsum(mask) - 1, where
    the model's check allows them; where not, the check gives a reason."""
    model, b = build(family), make_batch()
    T, ids, am = b["T"], b["ids"], b["am"]
    check = check_packed_attention if layout == "packed" else check_shared_prompt
    reason = check(model)
    if reason is not None:
        assert isinstance(reason, str) and len(reason) > 20  # a sentence for the log line
        return
    make = pack_sequences if layout == "packed" else share_prompts
    rows = make(ids, am, T, b["cm"], model_config=model.config)
    positions = (am.cumsum(1) - 1).clamp(min=0)
    row_mask = rows.attention_mask  # None for packed rows
    with force_backend("chunked"):
        got = completion_logprobs(model, rows.input_ids, row_mask, rows.logits_to_keep,
                                  position_ids=rows.position_ids, temperature=0.7).detach()
        with torch.no_grad():
            want = reference.logprobs_from_logits(own(model, b, positions), ids[:, -T:],
                                                  temperature=0.7)
        torch.testing.assert_close(got, rows.pack(want), rtol=1e-4, atol=1e-4)
        assert_same_loss(
            model,
            lambda: causal_lm_grpo_loss(model, rows.input_ids, row_mask, rows.logits_to_keep,
                                        b["adv"], None, rows.pack(b["old"]), rows.pack(b["ref"]),
                                        cu_seqlens=rows.cu_seqlens,
                                        position_ids=rows.position_ids,
                                        loss_fn=FusedLinearGRPOLoss(**HP))[0],
            lambda: reference.grpo_loss(own(model, b, positions), ids[:, -T:], b["adv"],
                                        b["cm"], b["old"], b["ref"], **HP)[0])


def test_logit_transforms_read_from_the_config():
    """RecurrentGemma's logits_soft_cap and xLSTM's output_logit_soft_cap are soft caps;
    MiniCPM3's logits_scaling (on the head's input) a scale of 1 / logits_scaling, as Granite's
    (on its output)."""
    assert logit_transform(build("recurrent-gemma-softcap")) == {"softcap": 0.5,
                                                                 "logit_scale": None}
    assert logit_transform(build("minicpm3-prescaled")) == {"softcap": None,
                                                            "logit_scale": 1 / 2.5}
    assert logit_transform(build("granite-logits-scaling")) == {"softcap": None,
                                                                "logit_scale": 0.25}
    assert logit_transform(build("xlstm-softcap")) == {"softcap": 0.5, "logit_scale": None}


def test_prescaled_hidden_states_before_a_biased_head_are_refused():
    """A scale on the head's input is a scale on its logits only without a bias: MiniCPM3 with
    a biased head is refused instead of getting s·(h·Wᵀ + b) for s·h·Wᵀ + b."""
    model = build("minicpm3-prescaled")
    old = model.get_output_embeddings()
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.normal_()
    model.set_output_embeddings(head)
    with pytest.raises(NotImplementedError, match="before an output embedding with a bias"):
        check_output_head(model)


def test_add_lora_all_linear_takes_conv1d_layers():
    """GPT-2's linear layers are transformers' Conv1D: add_lora's default "all-linear" with the
    head puts LoRA on them too (PEFT's meaning of all-linear), and the fused log-probs equal the
    wrapped model's own."""
    pytest.importorskip("peft")
    from grpo_kernels.hf import add_lora

    model = add_lora(build("gpt2"), r=4, alpha=8)
    names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters()
             if ".lora_A." in n}
    assert {"c_attn", "c_fc", "c_proj", "lm_head"} <= names
    with torch.no_grad():  # B = 0 at initialization: give the adapters an effect
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    b = make_batch()
    T, ids, cm = b["T"], b["ids"], b["cm"]
    with force_backend("chunked"):
        got = completion_logprobs(model, ids, b["am"], T).detach()
        with torch.no_grad():
            want = reference.logprobs_from_logits(own(model, b), ids[:, -T:])
    torch.testing.assert_close(got * cm, want * cm, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["padded+position_ids", "packed", "shared"])
def test_check_is_not_vacuous_when_the_first_call_passes_model_inputs(layout):
    """The once-per-model check runs on ordinary tokens, not the padding token 0, when the
    first call cannot hand it one row of its own batch (position_ids or another model input, a
    4-D mask). On token 0 a Llama body's output is zero (a zero embedding), so the head's output
    and the logits are too, and a logit transform the model does not apply would pass: here a
    logits_scaling the config names and LlamaForCausalLM ignores."""
    from grpo_kernels.hf import causal_lm_logprobs

    model, b = build("llama"), make_batch()
    model.config.logits_scaling = 4.0  # read by logit_transform, not applied by the model
    T, ids, am = b["T"], b["ids"], b["am"]
    if layout == "padded+position_ids":
        args = (ids, am, T)
        kwargs = dict(position_ids=(am.cumsum(1) - 1).clamp(min=0))
    else:
        make = pack_sequences if layout == "packed" else share_prompts
        rows = make(ids, am, T, b["cm"], model_config=model.config)
        args = (rows.input_ids, rows.attention_mask, rows.logits_to_keep)
        kwargs = dict(position_ids=rows.position_ids)
    with force_backend("chunked"), pytest.raises(NotImplementedError,
                                                 match="logits are not those"):
        causal_lm_logprobs(model, *args, **kwargs)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_sampling_logps_reach_the_off_policy_mask(layout):
    """causal_lm_grpo_loss takes the rollout engine's log-probs for the off-policy mask (as the
    fused loss does) instead of handing them to the model body, which ignores them."""
    model, b = build("llama"), make_batch()
    T, ids, am, cm = b["T"], b["ids"], b["am"], b["cm"]
    hp = dict(HP, off_policy_mask_threshold=0.5)
    adv = -b["adv"].abs()  # the mask drops negative-advantage sequences that drifted
    with torch.no_grad():  # old = the current policy: no drift unless the sampler's differ
        b["old"] = reference.logprobs_from_logits(own(model, b), ids[:, -T:], temperature=0.7)
    sampling = b["old"] + torch.tensor([[0.0], [2.0], [0.0], [2.0]])  # two sequences drifted
    with torch.no_grad():
        want, _ = reference.grpo_loss(own(model, b), ids[:, -T:], adv, cm, b["old"], b["ref"],
                                      sampling_logps=sampling, **hp)
        unmasked, _ = reference.grpo_loss(own(model, b), ids[:, -T:], adv, cm, b["old"],
                                          b["ref"], **hp)
    assert (want - unmasked).abs() > 1e-3  # the mask drops the drifted sequences
    if layout == "padded":
        args, kw = (ids, am, T, adv, cm, b["old"], b["ref"]), dict(sampling_logps=sampling)
    else:
        rows = pack_sequences(ids, am, T, cm, model_config=model.config)
        args = (rows.input_ids, None, rows.logits_to_keep, adv, None, rows.pack(b["old"]),
                rows.pack(b["ref"]))
        kw = dict(sampling_logps=rows.pack(sampling), cu_seqlens=rows.cu_seqlens,
                  position_ids=rows.position_ids)
        with torch.no_grad():  # packed rows equal the padded batch given its positions
            positions = (am.cumsum(1) - 1).clamp(min=0)
            want, _ = reference.grpo_loss(own(model, b, positions), ids[:, -T:], adv, cm,
                                          b["old"], b["ref"], sampling_logps=sampling, **hp)
    with force_backend("chunked"), torch.no_grad():
        loss, _ = causal_lm_grpo_loss(model, *args, loss_fn=FusedLinearGRPOLoss(**hp), **kw)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-6)


def test_loss_keywords_are_not_handed_to_the_model_body():
    """Keywords the helpers do not take go to the model's body, whose **kwargs ignore unknown
    ones: a GRPO hyperparameter there (beta, temperature) would change nothing, silently."""
    from grpo_kernels.hf import causal_lm_logprobs

    model, b = build("llama"), make_batch()
    T, ids, am = b["T"], b["ids"], b["am"]
    with pytest.raises(TypeError, match="beta, temperature: not a keyword here"):
        causal_lm_grpo_loss(model, ids, am, T, b["adv"], beta=0.5, temperature=0.3)
    with pytest.raises(TypeError, match="softcap: not a keyword here"):
        causal_lm_logprobs(model, ids, am, T, softcap=30.0)
    causal_lm_logprobs(model, ids, am, T, position_ids=(am.cumsum(1) - 1).clamp(min=0))


def test_check_reads_the_logits_of_a_tuple_output():
    """A model whose config has return_dict=False (Falcon keeps honouring it) returns a tuple;
    the check reads the logits from it instead of skipping the comparison with them, so a
    transform the config names and the model does not apply is still refused."""
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        return_dict=False))
    model.config.logits_scaling = 4.0  # read by logit_transform, not applied by the model
    with pytest.raises(NotImplementedError, match="logits are not those"):
        check_output_head(model)


def test_right_padded_prompts_are_refused_in_padded_rows():
    """In padded rows the first completion token is predicted from column L - T - 1: a prompt
    padded on the right (a tokenizer's default padding side) puts a padding position there,
    and its log-prob would be that of a padding state. Refused, naming the rows; a completion
    that is all padding there is fine (no token is predicted from it)."""
    model, b = build("llama"), make_batch()
    T, ids, am = b["T"], b["ids"], b["am"].clone()
    L = ids.shape[1]
    am[0, L - T - 2:L - T] = 0  # prompt of row 0 padded on the right
    with pytest.raises(ValueError, match=r"rows \[0\] have padding in the prompt's last column"):
        causal_lm_grpo_loss(model, ids, am, T, b["adv"])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        completion_logprobs(model, ids, am, T)
    am[0, L - T:] = 0  # no completion token: nothing is predicted from the padding
    completion_logprobs(model, ids, am, T)


def test_boolean_shared_mask_on_an_eager_model_is_refused():
    """share_prompts without model_config builds sdpa's boolean mask; eager attention adds its
    mask to the scores, so that mask would shift them (log-probs 0.29 off on this model)
    instead of masking: refused, and the mask built for the model's config matches."""
    model, b = build("llama"), make_batch()
    model.config._attn_implementation = "eager"
    T, ids, am = b["T"], b["ids"], b["am"]
    for config, ok in ((None, False), (model.config, True)):
        rows = share_prompts(ids, am, T, b["cm"], model_config=config)
        args = (model, rows.input_ids, rows.attention_mask, rows.logits_to_keep)
        if not ok:
            with pytest.raises(ValueError, match="boolean 4-D mask.*eager"):
                completion_logprobs(*args, position_ids=rows.position_ids)
            continue
        with force_backend("chunked"):
            got = completion_logprobs(*args, position_ids=rows.position_ids).detach()
            with torch.no_grad():
                positions = (am.cumsum(1) - 1).clamp(min=0)
                want = reference.logprobs_from_logits(own(model, b, positions), ids[:, -T:])
        torch.testing.assert_close(got, rows.pack(want), rtol=1e-4, atol=1e-4)


def test_layout_checks_draw_tokens_from_a_multimodal_text_vocabulary():
    """A multimodal config has no vocab_size of its own (its text config has): the layout
    checks draw their random tokens from the text vocabulary, not from ids 0 and 1 (padding,
    with a zero embedding, and a special token), where a leak between sequences shows less."""
    from grpo_kernels.hf import check_padded_positions

    text = dict(_COMMON, head_dim=8, sliding_window=None,
                layer_types=["full_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=V - 1,
        boi_token_index=V - 2, eoi_token_index=V - 3)).eval()
    assert getattr(model.config, "vocab_size", None) is None
    seen = []
    embed = model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(lambda _m, args: seen.append(int(args[0].max())))
    try:
        for check in (check_packed_attention, check_shared_prompt, check_padded_positions):
            seen.clear()
            check(model)
            assert seen and max(seen) > 1, check.__name__
    finally:
        handle.remove()
