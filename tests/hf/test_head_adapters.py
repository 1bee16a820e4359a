"""PEFT adapters on the output embedding (grpo_kernels.hf.head_adapters through grpo_kernels.hf).

Truth: the wrapped model's own forward (its logits for the completion positions) and the
materialized-logits reference loss. The fused path must give the same loss, the same gradient
for every trainable parameter (the head's LoRA factors included, which must be non-zero) and
the same log-probs, for plain LoRA (one or two active adapters, with lora_bias, through the
chunked PyTorch path and the Triton kernels), for the adapter's dropout, merged or disabled
adapters and `modules_to_save` heads; other adapters are errors that name the module.
"""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
from peft import LoraConfig, get_peft_model  # noqa: E402

from grpo_kernels import FusedLinearGRPOLoss, force_backend, reference  # noqa: E402
from grpo_kernels.hf import (  # noqa: E402
    causal_lm_grpo_loss,
    causal_lm_logprobs,
    check_output_head,
    completion_hidden_states,
    head_for,
    output_head,
)
from grpo_train.tiny import build_tiny_model, build_tokenizer  # noqa: E402

B, P, T = 3, 4, 5
L = P + T
HP = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28, entropy_coef=0.01)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def base():
    return build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=1,
                            tie_word_embeddings=False, seed=5).eval()


def wrap(base, **lora):
    """A PEFT model with LoRA on q_proj and lm_head; random (non-zero) B so the adapter shows."""
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False,
               lora_dropout=0.0)
    cfg.update(lora)
    torch.manual_seed(0)
    return get_peft_model(copy.deepcopy(base), LoraConfig(**cfg)).eval()


def make_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[0, :2] = 0
    am[1, -2:] = 0
    return dict(ids=ids, am=am, cmask=am[:, -T:].float(), adv=torch.randn(B, generator=g),
                old=-4.0 + 0.3 * torch.randn(B, T, generator=g),
                ref=-4.0 + 0.3 * torch.randn(B, T, generator=g))


def model_logits(model, batch):
    return model(input_ids=batch["ids"], attention_mask=batch["am"],
                 logits_to_keep=T + 1).logits[:, :-1]


def losses(model, batch):
    """(reference loss on the model's own logits, our fused loss)."""
    ref, _ = reference.grpo_loss(model_logits(model, batch), batch["ids"][:, -T:], batch["adv"],
                                 batch["cmask"], batch["old"], batch["ref"], **HP)
    got, _ = causal_lm_grpo_loss(model, batch["ids"], batch["am"], T, batch["adv"],
                                 batch["cmask"], batch["old"], batch["ref"],
                                 loss_fn=FusedLinearGRPOLoss(**HP))
    return ref, got


def trainable_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_matches_model(model, batch, head_params=("lm_head.lora_A", "lm_head.lora_B")):
    ref, got = losses(model, batch)
    torch.testing.assert_close(got, ref.float(), rtol=2e-6, atol=2e-7)
    g_ref, g_got = trainable_grads(model, ref), trainable_grads(model, got)
    assert g_ref.keys() == g_got.keys()
    scale = max(g.abs().max() for g in g_ref.values() if g is not None)
    for name, g in g_ref.items():
        assert g_got[name] is not None, f"no gradient for {name}"
        torch.testing.assert_close(g_got[name], g, rtol=1e-4, atol=2e-6 * scale,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
    for part in head_params:  # the head's own trainable parameters do learn
        hits = [n for n in g_got if part in n]
        assert hits and all(g_got[n].abs().sum() > 0 for n in hits), (part, list(g_got))
    return ref, got


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_lora_head_matches_the_wrapped_model(base, backend):
    model = wrap(base)
    batch = make_batch(base.config.vocab_size)
    with force_backend(backend):
        ref, got = assert_matches_model(model, batch)
        with model.disable_adapter():  # the loss without the adapter is clearly different
            _, plain = losses(model, batch)
    assert abs(plain.item() - got.item()) > 1e-3 * abs(got.item())


def test_logprobs_and_head_for_shapes(base):
    model = wrap(base, r=3)
    batch = make_batch(base.config.vocab_size, seed=1)
    want = reference.logprobs_from_logits(model_logits(model, batch), batch["ids"][:, -T:])
    with force_backend("chunked"):
        got = causal_lm_logprobs(model, batch["ids"], batch["am"], T, batch_size=2)
        hidden = completion_hidden_states(model, batch["ids"], batch["am"], T)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    h2, w2, b2 = head_for(hidden, model)
    D, V = base.config.hidden_size, base.config.vocab_size
    assert h2.shape == (B, T, D + 3) and w2.shape == (V, D + 3) and b2 is None
    with pytest.raises(ValueError, match="LoRA adapters \\(default\\)"):
        output_head(model)  # one weight cannot describe this head


def test_two_active_adapters_with_lora_bias(base):
    model = wrap(base, lora_bias=True)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=6, target_modules=["lm_head"],
                                           init_lora_weights=False, lora_bias=True))
    model.base_model.set_adapter(["default", "second"])
    for n, p in model.named_parameters():  # lora_B biases start at zero; make them count
        if "lora_B" in n and n.endswith("bias"):
            with torch.no_grad():
                p.normal_(0, 0.3)
    batch = make_batch(base.config.vocab_size, seed=2)
    with force_backend("chunked"):
        assert_matches_model(model, batch, head_params=("lm_head.lora_A.default",
                                                        "lm_head.lora_B.second"))


def test_dropout_is_applied_where_peft_applies_it(base):
    """Training mode with lora_dropout > 0: the adapter's own dropout module runs on the head's
    input. Replaced by a fixed (deterministic) mask, both paths see the same function."""
    model = wrap(base, lora_dropout=0.3).train()
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_dropout["default"] = \
        torch.nn.Identity()
    mask = (torch.rand(base.config.hidden_size, generator=torch.Generator().manual_seed(3))
            > 0.3).float() / 0.7

    class FixedDropout(torch.nn.Module):
        def forward(self, x):
            return x * mask.to(x.dtype)

    model.base_model.model.lm_head.lora_dropout["default"] = FixedDropout()
    for module in model.modules():  # the body's own dropouts off: one function on both paths
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    with force_backend("chunked"):
        assert_matches_model(model, make_batch(base.config.vocab_size, seed=3))


def test_merged_adapter_and_modules_to_save(base):
    model = wrap(base)
    batch = make_batch(base.config.vocab_size, seed=4)
    model.merge_adapter()  # PEFT then runs the merged base weight only
    with force_backend("chunked"):
        ref, got = losses(model, batch)
    torch.testing.assert_close(got, ref.float(), rtol=2e-6, atol=2e-7)
    # a fully trained copy of the head: ours must use (and train) the copy, not the original
    torch.manual_seed(1)
    saved = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=False))
    saved.eval()
    copy_head = saved.base_model.model.lm_head.modules_to_save["default"]
    with torch.no_grad():
        copy_head.weight.add_(0.2 * torch.randn_like(copy_head.weight))
    assert output_head(saved)[0] is copy_head.weight
    with force_backend("chunked"):
        assert_matches_model(saved, batch, head_params=("lm_head.modules_to_save",))


def test_unsupported_adapters_name_the_module(base):
    dora = wrap(base, use_dora=True)
    batch = make_batch(base.config.vocab_size)
    with pytest.raises(NotImplementedError, match="lm_head.*DoRA|lm_head.*Dora"):
        check_output_head(dora)
    with pytest.raises(NotImplementedError, match="lm_head"), force_backend("chunked"):
        causal_lm_grpo_loss(dora, batch["ids"], batch["am"], T, batch["adv"])
    torch.manual_seed(0)
    ia3 = get_peft_model(copy.deepcopy(base), peft.IA3Config(
        target_modules=["lm_head", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(NotImplementedError, match="(?i)lm_head.*ia3"):
        check_output_head(ia3)


def test_add_lora_puts_a_trainable_adapter_on_the_head(base):
    from grpo_kernels.hf.head_adapters import add_lora

    model = add_lora(copy.deepcopy(base), r=2, alpha=4, init_lora_weights=False)
    inner = model.get_base_model()
    assert isinstance(inner.lm_head, peft.tuners.lora.layer.Linear)
    assert isinstance(inner.model.layers[0].mlp.down_proj, peft.tuners.lora.layer.Linear)
    with force_backend("chunked"):
        assert_matches_model(model.eval(), make_batch(base.config.vocab_size, seed=5))
    with pytest.raises(NotImplementedError, match="lm_head"):
        add_lora(copy.deepcopy(base), r=2, use_dora=True)
    with pytest.raises(ValueError, match="r must be a positive int"):
        add_lora(copy.deepcopy(base), r=0)


def lora_modules(model) -> list[str]:
    inner = model.get_base_model()
    return sorted(n for n, m in inner.named_modules() if isinstance(m, peft.tuners.lora.Linear))


def test_add_lora_keeps_peft_target_modules_meaning(base):
    """A str target_modules is PEFT's regex over module names, a list names modules; the head
    joins either (a regex once became a list entry that matched nothing: the head alone)."""
    from grpo_kernels.hf.head_adapters import add_lora

    model = add_lora(copy.deepcopy(base), r=2, target_modules=r".*\.(q_proj|v_proj)")
    assert lora_modules(model) == ["lm_head", "model.layers.0.self_attn.q_proj",
                                   "model.layers.0.self_attn.v_proj"]
    assert lora_modules(add_lora(copy.deepcopy(base), r=2, target_modules="q_proj")) == [
        "lm_head", "model.layers.0.self_attn.q_proj"]
    assert lora_modules(add_lora(copy.deepcopy(base), r=2, target_modules=[])) == ["lm_head"]
    for targets in (r".*\.no_such_proj", ["no_such_proj"]):
        with pytest.raises(ValueError, match="target_modules"):
            add_lora(copy.deepcopy(base), r=2, target_modules=targets)
    with pytest.raises(ValueError, match="dropout"):
        add_lora(copy.deepcopy(base), r=2, dropout="0.1")


@pytest.mark.slow
def test_lora_example_runs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(repo / "examples" / "lora_head.py")],
                         capture_output=True, text=True, cwd=repo, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip() == "", out.stderr[-3000:]  # only the example's own lines
    assert "done:" in out.stdout and "lm_head.lora_B moved" in out.stdout
