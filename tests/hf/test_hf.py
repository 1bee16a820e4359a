"""grpo_kernels.hf: the hidden-state path must equal the model's own logits path.

Reference: the model's forward with logits for the completion positions, then the
materialized-logits GRPO loss of `grpo_kernels.reference`. Compared to float32 precision for the
loss and the gradients of every parameter, on real Hugging Face architectures: tied embeddings
(Qwen2), an output embedding that is not called `lm_head` (BioGPT's `output_projection`), an
lm_head with a bias (Phi), a DDP-style `.module` wrapper, autocast and mixed dtypes.
"""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BioGptConfig,
    BioGptForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PhiConfig,
    PhiForCausalLM,
)

from grpo_kernels import FusedLinearGRPOLoss, force_backend, reference  # noqa: E402
from grpo_kernels.hf import (  # noqa: E402
    causal_lm_grpo_loss,
    causal_lm_logprobs,
    check_output_head,
    completion_hidden_states,
    completion_logprobs,
    head_for,
    output_head,
    unwrap_model,
)
from grpo_train.tiny import build_tiny_model, build_tokenizer  # noqa: E402

B, P, T = 3, 4, 5  # sequences, prompt length, completion length
L = P + T


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_neox(vocab=60):
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=64, tie_word_embeddings=False)
    torch.manual_seed(1)
    return GPTNeoXForCausalLM(cfg).eval()  # eval: no dropout, so both paths see one function


def tiny_biogpt(vocab=60):
    cfg = BioGptConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=4, intermediate_size=64, tie_word_embeddings=False)
    torch.manual_seed(4)
    return BioGptForCausalLM(cfg).eval()


def tiny_phi(vocab=60):
    cfg = PhiConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                    intermediate_size=64, tie_word_embeddings=False)
    torch.manual_seed(2)
    model = PhiForCausalLM(cfg).eval()
    with torch.no_grad():  # a non-zero bias, so that dropping it would show
        model.lm_head.bias.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def qwen():
    return build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=1, seed=3).eval()


def make_batch(vocab, seed=0):
    """Left-padded prompts, right-padded completions (TRL's layout): ids/mask [B, L]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[0, :2] = 0  # left padding of a prompt
    am[1, -2:] = 0  # a completion of length T-2
    am[2, -T + 1:] = 0  # a completion of length 1
    return dict(
        ids=ids, am=am, cmask=am[:, -T:].float(),
        adv=torch.randn(B, generator=g),
        old=-4.0 + 0.3 * torch.randn(B, T, generator=g),
        ref=-4.0 + 0.3 * torch.randn(B, T, generator=g),
    )


def reference_loss(model, batch, **hp):
    """Loss through the model's own lm_head (logits for the last T+1 positions)."""
    logits = model(input_ids=batch["ids"], attention_mask=batch["am"],
                   logits_to_keep=T + 1).logits[:, :-1]
    return reference.grpo_loss(logits, batch["ids"][:, -T:], batch["adv"], batch["cmask"],
                               batch["old"], batch["ref"], **hp)


def ours(model, batch, **hp):
    return causal_lm_grpo_loss(model, batch["ids"], batch["am"], T, batch["adv"], batch["cmask"],
                               batch["old"], batch["ref"], loss_fn=FusedLinearGRPOLoss(**hp))


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(model, batch, call=ours, **hp):
    ref, ref_metrics = reference_loss(model, batch, **hp)
    got, metrics = call(model, batch, **hp)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref.float(), rtol=2e-6, atol=2e-7)
    for k, v in ref_metrics.items():
        torch.testing.assert_close(metrics[k], v.float(), rtol=1e-5, atol=1e-6)
    g_ref, g_got = grads_of(model, ref), grads_of(model, got)
    assert g_ref.keys() == g_got.keys() and len(g_ref) == len(list(model.parameters()))
    scale = max(g.abs().max() for g in g_ref.values())
    for name in g_ref:
        torch.testing.assert_close(g_got[name], g_ref[name], rtol=1e-4, atol=2e-6 * scale,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


HP_CASES = [
    dict(loss_type="grpo", beta=0.04),
    dict(loss_type="dapo", epsilon_high=0.28, entropy_coef=0.01),
    dict(loss_type="bnpo", importance_sampling_level="sequence", beta=0.04, temperature=0.7),
]


@pytest.mark.parametrize("hp", HP_CASES, ids=lambda hp: hp["loss_type"])
def test_tied_embeddings_match_model_logits(qwen, hp):
    weight, bias = output_head(qwen)
    assert weight is qwen.get_input_embeddings().weight and bias is None  # tied
    with force_backend("chunked"):
        assert_same_loss_and_grads(qwen, make_batch(qwen.config.vocab_size), **hp)


def test_triton_path_matches_model_logits(qwen):
    """Default dispatch: the Triton kernels (the interpreter on CPU under the test set-up)."""
    assert_same_loss_and_grads(qwen, make_batch(qwen.config.vocab_size, seed=1), **HP_CASES[0])


def test_output_embedding_not_named_lm_head():
    model = tiny_biogpt()
    assert not hasattr(model, "lm_head")  # BioGPT calls it output_projection
    assert output_head(model)[0] is model.output_projection.weight
    with force_backend("chunked"):
        assert_same_loss_and_grads(model, make_batch(60), **HP_CASES[1])


def test_lm_head_bias():
    model = tiny_phi()
    assert output_head(model)[1] is model.lm_head.bias
    with force_backend("chunked"):
        assert_same_loss_and_grads(model, make_batch(60), **HP_CASES[0])
    assert model.lm_head.bias.grad is not None and model.lm_head.bias.grad.abs().sum() > 0


def test_head_fed_by_a_sub_model_of_the_body():
    """OPTForCausalLM's forward runs base_model.decoder, never base_model: the decoder is the
    body (its output feeds the head), directly and through a wrapper."""
    cfg = OPTConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                    ffn_dim=64, word_embed_proj_dim=32)
    torch.manual_seed(5)
    model = OPTForCausalLM(cfg).eval()
    check_output_head(model)
    with force_backend("chunked"):
        assert_same_loss_and_grads(model, make_batch(60), **HP_CASES[0])
        wrapped = DDPLike(model)
        assert_same_loss_and_grads(model, make_batch(60, seed=2),
                                   call=lambda _m, b, **hp: ours(wrapped, b, **hp), **HP_CASES[0])
    assert wrapped.calls == 1


class DDPLike(nn.Module):
    """A wrapper with `.module`, like DistributedDataParallel: it must be called, not bypassed."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def test_wrapped_model_is_called_through_its_wrapper(qwen):
    wrapped = DDPLike(qwen)
    assert unwrap_model(wrapped) is qwen
    batch = make_batch(qwen.config.vocab_size, seed=2)
    with force_backend("chunked"):
        assert_same_loss_and_grads(qwen, batch, call=lambda m, b, **hp: ours(wrapped, b, **hp),
                                   **HP_CASES[0])
    assert wrapped.calls >= 1
    h_wrapped = completion_hidden_states(wrapped, batch["ids"], batch["am"], T)
    h_plain = completion_hidden_states(qwen, batch["ids"], batch["am"], T)
    assert h_plain.shape == (B, T, qwen.config.hidden_size)
    torch.testing.assert_close(h_wrapped, h_plain)


def test_logprobs_no_grad_chunked_and_entropy(qwen):
    batch = make_batch(qwen.config.vocab_size, seed=3)
    logits = qwen(input_ids=batch["ids"], attention_mask=batch["am"],
                  logits_to_keep=T + 1).logits[:, :-1]
    ref_lp, ref_ent = reference.logprobs_from_logits(logits, batch["ids"][:, -T:],
                                                     temperature=0.9, return_entropy=True)
    with force_backend("chunked"):
        lp = causal_lm_logprobs(qwen, batch["ids"], batch["am"], T, temperature=0.9, batch_size=2)
        lp2, ent = completion_logprobs(qwen, batch["ids"], batch["am"], T, temperature=0.9,
                                       return_entropy=True)
    assert lp.shape == (B, T) and lp.dtype == torch.float32 and not lp.requires_grad
    assert lp2.requires_grad  # the differentiable variant
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp2.detach(), lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    # per-sequence model inputs are chunked with the batch: position_ids [B, L] that stretch
    # sequence b's positions by b + 1 (RoPE sees that), whole batch vs chunks of 2
    pos = torch.arange(L)[None] * (1 + torch.arange(B)[:, None])
    with force_backend("chunked"):
        whole = causal_lm_logprobs(qwen, batch["ids"], batch["am"], T, position_ids=pos)
        chunked = causal_lm_logprobs(qwen, batch["ids"], batch["am"], T, position_ids=pos,
                                     batch_size=2)
        plain = causal_lm_logprobs(qwen, batch["ids"], batch["am"], T)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(whole[2], plain[2])


def test_autocast_runs_head_in_autocast_dtype(qwen):
    """Under bf16 autocast the model's lm_head runs in bf16; so does ours (fp32 accumulation,
    gradients back to the fp32 parameters)."""
    batch = make_batch(qwen.config.vocab_size, seed=4)
    with force_backend("chunked"), torch.autocast("cpu", dtype=torch.bfloat16):
        (ref, _), (got, _) = reference_loss(qwen, batch), ours(qwen, batch)
        h = completion_hidden_states(qwen, batch["ids"], batch["am"], T)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref.float(), rtol=0.05, atol=0.02)
    grads = grads_of(qwen, got)
    w = output_head(qwen)[0]
    assert grads["model.embed_tokens.weight"].dtype == w.dtype == torch.float32
    assert all(torch.isfinite(g).all() for g in grads.values())
    # and the autocast result differs from the float32 one only by bf16 rounding
    with force_backend("chunked"):
        full, _ = ours(qwen, batch)
    torch.testing.assert_close(got, full, rtol=0.05, atol=0.02)
    assert h.shape == (B, T, qwen.config.hidden_size)


def _mixed_head_refused():
    """Why the kernels refuse 16-bit hidden with a float32 weight, or None if they take it."""
    from grpo_kernels.validation import check_linear_head

    try:
        check_linear_head(torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(3, 4), None)
    except TypeError as exc:
        return f"check_linear_head refuses mixed head precision in this checkout: {exc}"
    return None


def test_mixed_dtypes_use_the_head_dtype():
    """A bf16 body with a float32 head (TRL's cast_lm_head_to_fp32): the hidden states go to the
    kernels as bf16 with the float32 weight (mixed head precision, no up-cast copy), giving the
    float32 head's logits; head_dtype= overrides the head dtype."""
    if (why := _mixed_head_refused()) is not None:
        pytest.skip(why)
    model = tiny_neox().to(torch.bfloat16)
    model.lm_head.float()
    with torch.no_grad():  # a float32 head that bf16 cannot represent (trained in float32)
        w = model.lm_head.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(6)) * 1e-2)
    batch = make_batch(60, seed=5)
    with torch.no_grad():
        hidden = completion_hidden_states(model, batch["ids"], batch["am"], T)
        assert hidden.dtype == torch.bfloat16
        h2, w2, _ = head_for(hidden, model)
        assert h2 is hidden and w2.dtype == torch.float32  # passed as is, not cast up
        w = model.lm_head.weight
        want = reference.selective_logprobs(hidden.float(), w, batch["ids"][:, -T:])
        want16 = reference.selective_logprobs(hidden, w.bfloat16(), batch["ids"][:, -T:])
    with force_backend("chunked"):
        got = causal_lm_logprobs(model, batch["ids"], batch["am"], T)
        got16 = causal_lm_logprobs(model, batch["ids"], batch["am"], T, head_dtype=torch.bfloat16)
        loss, _ = ours(model, batch, loss_type="grpo")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got16, want16, rtol=1e-2, atol=1e-2)
    assert not torch.equal(got, got16)
    loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert model.gpt_neox.embed_in.weight.grad.dtype == torch.bfloat16


def test_clear_errors(qwen):
    batch = make_batch(qwen.config.vocab_size)
    ids, am = batch["ids"], batch["am"]
    with pytest.raises(ValueError, match="input_ids"):
        completion_hidden_states(qwen, ids[0], None, T)
    for bad in (0, L, -1):
        with pytest.raises(ValueError, match="logits_to_keep"):
            completion_hidden_states(qwen, ids, am, bad)
    with pytest.raises(TypeError, match="logits_to_keep"):
        completion_hidden_states(qwen, ids, am, float(T))
    with pytest.raises(ValueError, match="attention_mask"):
        completion_hidden_states(qwen, ids, am[:, 1:], T)
    with pytest.raises(ValueError, match="batch_size"):
        causal_lm_logprobs(qwen, ids, am, T, batch_size=0)
    with pytest.raises(TypeError, match="loss_fn"):
        causal_lm_grpo_loss(qwen, ids, am, T, batch["adv"], loss_fn=object())
    with pytest.raises(ValueError, match="advantages"):  # validated by the loss, named
        causal_lm_grpo_loss(qwen, ids, am, T, batch["adv"][:2])
    with pytest.raises(ValueError, match="output embedding"):
        output_head(qwen.model)  # the bare body has no lm_head
    # ids the input embedding does not hold failed inside it (IndexError, a RuntimeError for
    # float ids): refused by name; -100 gets the padding hint
    V = qwen.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=f"input_ids has token id {V} outside \\[0, {V}\\)"):
        causal_lm_grpo_loss(qwen, ids.clamp(max=V - 1).index_fill(1, torch.tensor([L - 1]), V),
                            am, T, batch["adv"])
    with pytest.raises(ValueError, match="input_ids has token id -100 .* not -100"):
        causal_lm_logprobs(qwen, ids.index_fill(1, torch.tensor([0]), -100), am, T)
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        completion_hidden_states(qwen, ids.float(), am, T)
    # a head_dtype that is not a float dtype failed in a cast ("Invalid device string") or was
    # blamed on hidden
    for bad in ("bfloat16", torch.int64):
        with pytest.raises(TypeError, match="head_dtype must be None or one of"):
            causal_lm_grpo_loss(qwen, ids, am, T, batch["adv"], head_dtype=bad)
        with pytest.raises(TypeError, match="head_dtype must be None or one of"):
            causal_lm_logprobs(qwen, ids, am, T, head_dtype=bad)
    # a config that names a logit transform its model does not apply: the logits check refuses
    qwen.config.logits_scaling = 4.0
    try:
        from grpo_kernels.hf.head_check import _HEAD_CHECKED

        _HEAD_CHECKED.pop(qwen, None)
        with pytest.raises(NotImplementedError, match="logits are not those"):
            causal_lm_logprobs(qwen, ids, am, T)
    finally:
        del qwen.config.logits_scaling
        _HEAD_CHECKED.pop(qwen, None)


@pytest.mark.parametrize("family", ["gemma2-softcap", "cohere-scale"])
def test_logit_transform_models_match_their_own_logits(family):
    """Gemma 2 soft-caps its logits, Cohere scales them: the fused log-probs and the GRPO loss
    equal those of the model's own logits (and differ from the untransformed head's)."""
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    from grpo_kernels import fused_linear_grpo_loss
    from grpo_kernels.hf import completion_hidden_states, head_for, logit_transform
    from grpo_kernels.reference import logprobs_from_logits

    torch.manual_seed(0)
    common = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=32)
    if family == "gemma2-softcap":  # a cap below the logits' spread, so that tanh bends them
        model = Gemma2ForCausalLM(Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.5))
        want_transform = {"softcap": 0.5, "logit_scale": None}
    else:
        model = CohereForCausalLM(CohereConfig(**common, logit_scale=0.25))
        want_transform = {"softcap": None, "logit_scale": 0.25}
    assert logit_transform(model) == want_transform
    with torch.no_grad():  # logits of a few units (random weights give tenths)
        model.get_output_embeddings().weight.mul_(40.0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (3, 9), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0
    T = 4
    logits = model(input_ids=ids, attention_mask=am).logits[:, -T - 1:-1]
    want = logprobs_from_logits(logits.double(), ids[:, -T:])
    got = causal_lm_logprobs(model, ids, am, T)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    hidden, weight, bias = head_for(completion_hidden_states(model, ids, am, T), model)
    plain = logprobs_from_logits((hidden @ weight.T).double(), ids[:, -T:])
    assert (plain - want).abs().max() > 1e-2  # the transform matters here
    # the loss through causal_lm_grpo_loss takes the model's transform
    adv = torch.randn(3, generator=g)
    loss, _ = causal_lm_grpo_loss(model, ids, am, T, adv)
    ref, _ = fused_linear_grpo_loss(hidden.detach(), weight.detach(), ids[:, -T:], adv,
                                    **want_transform)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def test_head_with_its_own_transform_is_rejected():
    """RoBERTa's causal LM head runs dense + layer norm before its decoder: projecting the body's
    output would be silently wrong, so the one-time check refuses it."""
    from transformers import RobertaConfig, RobertaForCausalLM

    cfg = RobertaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, is_decoder=True)
    model = RobertaForCausalLM(cfg)
    batch = make_batch(60)
    with pytest.raises(NotImplementedError, match="directly to the output of its body"):
        check_output_head(model)
    with pytest.raises(NotImplementedError, match="directly to the output of its body"):
        causal_lm_grpo_loss(model, batch["ids"], batch["am"], T, batch["adv"])
    check_output_head(tiny_phi())  # a plain (biased) linear head passes
