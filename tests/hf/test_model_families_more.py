"""grpo_kernels.hf on more model families than test_model_families.py: per-token log-probs and
entropies against a float64 run of the model's own forward (logits -> log_softmax), and the
loss's gradient for every parameter (head, body, vision tower) against the model's own float32
logits under TRL's GRPO loss (`grpo_kernels.reference`).

The families: Qwen3, Mistral, Gemma (scaled input embeddings), Gemma 3 (text) and VaultGemma
with final-logit soft-capping, Cohere 2 (logit_scale), Phi-3, OLMo 2, GPT-J (a biased head),
Falcon-H1 (lm_head_multiplier), Mamba (a body called `backbone`), PaliGemma with a Gemma 2 text
model (the wrapper applies the text config's soft cap), Kosmos 2.5 (a causal LM of its own
inside the wrapper, beside its vision model), Qwen2-VL and Gemma 3 with images.
Vision-language wrappers that leave their text config's logit transform unapplied (Aya Vision
and Cohere 2 Vision with Cohere 2's default logit_scale, Gemma 3 or LLaVA with a soft cap in
the text config) are reproduced as their forward runs them, and Inkling's padded head (its
logits are the first unpadded_vocab_size rows' outputs) as its logits are. Chameleon, which
masks logits in place in its head's output, is refused.
"""

import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from test_model_families import _COMMON, assert_same_loss  # noqa: E402

from grpo_kernels import FusedLinearGRPOLoss, force_backend, reference  # noqa: E402
from grpo_kernels.hf import (  # noqa: E402
    causal_lm_grpo_loss,
    check_output_head,
    completion_logprobs,
    logit_transform,
    output_head,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V = 96
TEXT = _COMMON  # the tiny text model of test_model_families
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              image_size=28, patch_size=14)
SIGLIP = dict(VISION, model_type="siglip_vision_model")
GEMMA3_VL = dict(mm_tokens_per_image=4, image_token_index=V - 1, boi_token_index=V - 2,
                 eoi_token_index=V - 3)
# family -> (config class, model class, config keywords)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TEXT, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(TEXT, head_dim=8)),
    "gemma-scaled-embeddings": ("GemmaConfig", "GemmaForCausalLM", dict(TEXT, head_dim=8)),
    "gemma3-softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                       dict(TEXT, head_dim=8, final_logit_softcapping=0.5)),
    "vaultgemma-softcap": ("VaultGemmaConfig", "VaultGemmaForCausalLM",
                           dict(TEXT, head_dim=8, final_logit_softcapping=0.5)),
    "cohere2-scale": ("Cohere2Config", "Cohere2ForCausalLM", dict(TEXT, logit_scale=0.25)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", TEXT),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", TEXT),
    "gptj-bias": ("GPTJConfig", "GPTJForCausalLM",
                  dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                       rotary_dim=4)),
    "falcon-h1-multiplier": ("FalconH1Config", "FalconH1ForCausalLM",
                             dict(TEXT, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4,
                                  mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                                  mamba_chunk_size=4, lm_head_multiplier=0.3)),
    "mamba": ("MambaConfig", "MambaForCausalLM",
              dict(vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2)),
    # the wrapper applies its Gemma 2 text config's soft cap
    "paligemma-gemma2-softcap": ("PaliGemmaConfig", "PaliGemmaForConditionalGeneration",
                                 dict(text_config=dict(TEXT, model_type="gemma2", head_dim=8,
                                                       final_logit_softcapping=0.5),
                                      vision_config=dict(SIGLIP, projection_dim=32),
                                      image_token_index=V - 1)),
    # the wrappers below apply no transform, whatever their text config names
    "aya-vision-unapplied-scale": ("AyaVisionConfig", "AyaVisionForConditionalGeneration",
                                   dict(text_config=dict(TEXT, model_type="cohere2"),
                                        vision_config=SIGLIP, image_token_index=V - 1,
                                        downsample_factor=1)),
    "gemma3-vl-unapplied-softcap": ("Gemma3Config", "Gemma3ForConditionalGeneration",
                                    dict(text_config=dict(TEXT, head_dim=8,
                                                          final_logit_softcapping=0.5),
                                         vision_config=VISION, **GEMMA3_VL)),
    # its text model is a causal LM of its own (text_model.model, text_model.lm_head) beside
    # its vision model, and its base_model is the wrapper itself
    "kosmos2.5-inner-causal-lm": ("Kosmos2_5Config", "Kosmos2_5ForConditionalGeneration",
                                  dict(text_config=dict(vocab_size=V, embed_dim=32, layers=2,
                                                        ffn_dim=64, attention_heads=4,
                                                        max_position_embeddings=64),
                                       vision_config=dict(VISION, patch_embed_hidden_size=32,
                                                          head_dim=8),
                                       latent_query_num=4)),
    # logits: the first unpadded_vocab_size of the head's V + 8 rows
    "inkling-padded-head": ("InklingTextConfig", "InklingForCausalLM",
                            dict(TEXT, vocab_size=V + 8, unpadded_vocab_size=V,
                                 logits_mup_width_multiplier=4.0, head_dim=8, swa_head_dim=8,
                                 moe_intermediate_size=32, n_routed_experts=4,
                                 num_experts_per_tok=2, rel_extent=16)),
}
HP = dict(beta=0.04, temperature=0.7)
T = 4


def build(family: str) -> nn.Module:
    config_cls, model_cls, kwargs = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    with torch.no_grad():  # logits of a few units: transforms bend them (test_model_families)
        model.get_output_embeddings().weight.mul_(8.0)
    return model.float().eval()


def make_batch():
    """3 sequences [3, 9], the last T = 4 columns the completion, tokens below the image ids;
    row 1's prompt left-padded, row 2's completion right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V - 5, (3, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, :2] = am[2, -1] = 0
    ids[am == 0] = 0
    return ids, am


def own_logits(model, ids, am, **inputs):
    """The model's own logits [B, T, V'] of the completion positions (V' its output's width)."""
    out = model(input_ids=ids, attention_mask=am, use_cache=False, **inputs)
    return out.logits[:, -T - 1:-1]


def truth(model, ids, am):
    """(log-probs, entropies) [B, T] float64 from the model's own forward run in float64, or
    from its float32 logits where the float64 forward gives NaN (padding rows of some eager
    attention masks) or cannot run (grouped expert matmuls take no float64)."""
    import copy

    with torch.no_grad():
        try:
            logits = own_logits(copy.deepcopy(model).double(), ids, am)
        except RuntimeError:
            logits = None
        if logits is None or logits.isnan().any():
            logits = own_logits(model, ids, am).double()
    return reference.logprobs_from_logits(logits, ids[:, -T:], temperature=0.7,
                                          return_entropy=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logprobs_entropy_and_gradients_match_the_models_own(family):
    model = build(family)
    ids, am = make_batch()
    cm = am[:, -T:]
    want, want_entropy = truth(model, ids, am)
    with force_backend("chunked"):
        got, entropy = completion_logprobs(model, ids, am, T, temperature=0.7,
                                           return_entropy=True)
    real = cm.bool()
    assert (got.double() - want)[real].abs().max() < 1e-4
    assert (entropy.double() - want_entropy)[real].abs().max() < 1e-4
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(3, generator=g)
    old = torch.where(real, want.float(), 0.0) - 0.05
    ref = old + 0.1 * torch.randn(3, T, generator=g)
    with force_backend("chunked"):
        assert_same_loss(
            model,
            lambda: causal_lm_grpo_loss(model, ids, am, T, adv, cm, old, ref,
                                        loss_fn=FusedLinearGRPOLoss(**HP))[0],
            lambda: reference.grpo_loss(own_logits(model, ids, am).float(), ids[:, -T:], adv,
                                        cm, old, ref, **HP)[0])


@pytest.mark.parametrize("family", ["aya-vision-unapplied-scale",
                                    "gemma3-vl-unapplied-softcap"])
def test_transform_a_wrapper_leaves_unapplied_is_not_applied(family, caplog):
    """Aya Vision's forward projects its Cohere 2 text model's states with its own lm_head and
    leaves the text config's logit_scale (0.0625 by default) unapplied; so does Gemma 3's with
    a soft cap. Once its forward has shown it, `logit_transform` gives what the model applies,
    and one INFO line names the unapplied setting."""
    model = build(family)
    named = {"softcap": 0.5, "logit_scale": None} if "gemma3" in family else {
        "softcap": None, "logit_scale": 0.0625}
    assert logit_transform(model) == named  # the config's, before the check
    with caplog.at_level(logging.INFO, logger="grpo_kernels"):
        check_output_head(model)
    assert logit_transform(model) == {"softcap": None, "logit_scale": None}
    lines = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert len(lines) == 1 and type(model).__name__ in lines[0], lines


def test_first_call_a_loss_takes_the_transform_the_model_applies():
    """The loss reads the model's transform after the forward that checks it: a first call that
    is a loss (no log-probs before it) on Aya Vision leaves the unapplied logit_scale out."""
    model = build("aya-vision-unapplied-scale")
    ids, am = make_batch()
    cm, adv = am[:, -T:], torch.tensor([1.0, -0.5, 0.3])
    old = torch.full((3, T), -4.0)  # the loss's ratio and KL term read the log-probs
    with force_backend("chunked"), torch.no_grad():
        loss, _ = causal_lm_grpo_loss(model, ids, am, T, adv, cm, old, old - 0.1,
                                      loss_fn=FusedLinearGRPOLoss(**HP))
        want, _ = reference.grpo_loss(own_logits(model, ids, am).float(), ids[:, -T:], adv, cm,
                                      old, old - 0.1, **HP)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-6)


def test_a_transform_no_candidate_explains_is_still_refused():
    """The fallback takes only what the model's logits show: a logit scale the config names and
    the wrapper ignores, on a model whose logits are something else again, is refused."""
    model = build("aya-vision-unapplied-scale")
    # the model's logits made 3 times its head's output: neither 1 nor 0.0625 times
    hook = model.register_forward_hook(
        lambda _m, _a, out: setattr(out, "logits", out.logits * 3.0))
    try:
        with pytest.raises(NotImplementedError, match="AyaVisionForConditionalGeneration's "
                                                      "logits are not those"):
            check_output_head(model)
    finally:
        hook.remove()


def test_logits_masked_in_place_are_refused():
    """Chameleon's forward sets its image tokens' logits to the dtype's minimum in place, in the
    tensor its head returned: the check compares the logits with a copy of the head's output
    taken when the head ran, so the masking shows and the model is refused (the fused softmax
    would run over the masked entries too: every log-prob a little off)."""
    if not hasattr(transformers, "ChameleonForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Chameleon")
    vq = dict(embed_dim=8, num_embeddings=16, base_channels=32, channel_multiplier=[1, 1],
              num_res_blocks=1, latent_channels=32, resolution=16, attn_resolutions=[])
    image_tokens = {f"IMGIMG{chr(65 + i)}Z": V - 10 + i for i in range(10)}
    torch.manual_seed(0)
    model = transformers.ChameleonForConditionalGeneration(transformers.ChameleonConfig(
        **TEXT, vq_config=vq, vocabulary_map=image_tokens)).eval()
    with pytest.raises(NotImplementedError, match="ChameleonForConditionalGeneration's logits "
                                                  "are not those.*10 of its 96 logits"):
        check_output_head(model)


def test_padded_head_gives_the_unpadded_rows():
    """Inkling's head has V + 8 rows and its logits are the first unpadded_vocab_size = V: the
    fused path takes those rows (weight [V, D]), so its softmax runs over the model's V logits."""
    model = build("inkling-padded-head")
    weight, bias = output_head(model)
    assert weight.shape == (V, 32) and bias is None
    assert model.get_output_embeddings().weight.shape == (V + 8, 32)


def test_lora_on_a_padded_head_takes_its_rows_too():
    """A LoRA adapter on Inkling's padded head: its up-projection [V + 8, r] is cut to the same
    V rows, and log-probs and gradients (the adapter's included) equal the wrapped model's."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(build("inkling-padded-head"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False)).eval()
    ids, am = make_batch()
    cm, adv = am[:, -T:], torch.tensor([1.0, -0.5, 0.3])
    with force_backend("chunked"):
        got = completion_logprobs(model, ids, am, T, temperature=0.7).detach()
        with torch.no_grad():
            logits = own_logits(model, ids, am).float()
        want = reference.logprobs_from_logits(logits, ids[:, -T:], temperature=0.7)
        torch.testing.assert_close(got[cm.bool()], want[cm.bool()], rtol=1e-4, atol=1e-4)
        hp = dict(beta=0.0, temperature=0.7)
        got_grads = assert_same_loss(
            model,
            lambda: causal_lm_grpo_loss(model, ids, am, T, adv, cm, want - 0.05,
                                        loss_fn=FusedLinearGRPOLoss(**hp))[0],
            lambda: reference.grpo_loss(own_logits(model, ids, am).float(), ids[:, -T:], adv,
                                        cm, want - 0.05, **hp)[0])
    assert any("lm_head.lora_B" in n for n in got_grads)


def test_gemma3_images_match_the_models_own_logits():
    """Gemma 3 with images: pixel_values and token_type_ids (the image tokens attend to each
    other both ways) go to the body; log-probs, loss and every gradient, the vision tower's
    included, equal the model's own."""
    model = build("gemma3-vl-unapplied-softcap")
    with torch.no_grad():  # initialized to zeros: no image would reach the text model
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, V - 5, (2, 12), generator=g)
    ids[:, 2:6] = V - 1  # 4 image tokens per image
    am = torch.ones_like(ids)
    am[1, 0], ids[1, 0] = 0, 0
    inputs = dict(pixel_values=torch.randn(2, 3, 28, 28, generator=g),
                  token_type_ids=(ids == V - 1).long())
    cm, adv = am[:, -T:], torch.tensor([1.0, -0.7])
    with force_backend("chunked"):
        got = completion_logprobs(model, ids, am, T, temperature=0.7, **inputs).detach()
        with torch.no_grad():
            logits = own_logits(model, ids, am, **inputs).float()
        want = reference.logprobs_from_logits(logits, ids[:, -T:], temperature=0.7)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        hp = dict(beta=0.0, temperature=0.7)
        got_grads = assert_same_loss(
            model,
            lambda: causal_lm_grpo_loss(model, ids, am, T, adv, cm,
                                        loss_fn=FusedLinearGRPOLoss(**hp), **inputs)[0],
            lambda: reference.grpo_loss(own_logits(model, ids, am, **inputs).float(),
                                        ids[:, -T:], adv, cm, **hp)[0])
    vision = [n for n in got_grads if "vision_tower" in n and got_grads[n].abs().sum() > 0]
    assert vision  # the loss reaches the vision tower through the image tokens


def test_a_wrapper_that_names_no_output_embedding_is_refused_for_that(monkeypatch):
    """A wrapper of several sub-models whose get_output_embeddings() is None (NemotronH Omni's,
    whose head sits in its language_model) is refused for the missing output embedding, which
    the hidden-state path projects with, before any search for its body."""
    model = build("kosmos2.5-inner-causal-lm")
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    ids, am = make_batch()
    with pytest.raises(ValueError, match="Kosmos2_5ForConditionalGeneration has no output "
                                         "embedding"):
        completion_logprobs(model, ids, am, T)
