"""The attention choice of the scoring and loss forwards (`grpo_kernels.hf.choose_attention`):
the rule table, each fallback with its reason, a requested implementation checked or refused,
the swap around a block (`using_attention`), one log line per (choice, reason) in a fresh
process, and the chosen implementation's packed and shared forwards equal to the padded forward
under the model's own implementation (loss and every gradient). PyTorch's varlen kernel runs on
CUDA only: here a reference stand-in (per-segment causal sdpa) checks the plumbing around it
(boundaries, grouped-query heads, the autocast cast) on the CPU."""

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_kernels import FusedLinearGRPOLoss
from grpo_kernels.hf import (
    ATTENTION_RULES,
    AttentionRule,
    RowLayout,
    causal_lm_grpo_loss,
    choose_attention,
    plan_rows,
    row_inputs,
    torch_varlen,
    using_attention,
)
from grpo_kernels.hf import attention_choice as ac

pytestmark = pytest.mark.usefixtures("one_thread")
LAYOUTS = (RowLayout.PADDED, RowLayout.PACKED, RowLayout.SHARED)


def tiny_qwen(attn="sdpa", seed=0, **extra):
    torch.manual_seed(seed)
    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    return Qwen2ForCausalLM(Qwen2Config(**{**sizes, **extra}, attn_implementation=attn)).float()


def grouped_batch(G=3, T=6, seed=1):
    """Three groups of G: left-padded prompts of 5, 7 and 2 tokens, completions of varied
    lengths (full, partial, one token, none)."""
    g = torch.Generator().manual_seed(seed)
    lengths, Lp = (5, 7, 2), 7
    S = 3 * G
    ids = torch.randint(1, 97, (S, Lp + T), generator=g)
    attn = torch.ones(S, Lp + T, dtype=torch.long)
    for k, n in enumerate(lengths):
        ids[k * G:(k + 1) * G, :Lp] = ids[k * G, :Lp]
        attn[k * G:(k + 1) * G, :Lp - n] = 0
    kept = torch.tensor([T, 2, 0, 1, T, 4, 3, T, 5][:S])
    mask = (torch.arange(T) < kept[:, None]).long()
    attn[:, Lp:] = mask
    return ids, attn, mask, T


def loss_and_grads(model, ids, attn, T, mask, layout):
    """Loss and every gradient of one fused-loss forward + backward on `layout` rows."""
    adv = torch.linspace(-1, 1, ids.shape[0])
    ref = -3 + 0.1 * torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(2))
    fn = FusedLinearGRPOLoss(beta=0.04)
    if layout is RowLayout.PADDED:
        loss, _ = causal_lm_grpo_loss(model, ids, attn, T, adv, mask.float(), None, ref,
                                      loss_fn=fn, position_ids=(attn.cumsum(1) - 1).clamp(min=0))
    else:
        rows = plan_rows(ids, attn, T, mask, layout, model.config)
        loss, _ = causal_lm_grpo_loss(model, rows.input_ids, rows.attention_mask,
                                      rows.logits_to_keep, adv, None, None, rows.pack(ref),
                                      loss_fn=fn, cu_seqlens=rows.cu_seqlens,
                                      **row_inputs(rows, model.config))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_rule_table_names_known_implementations_with_a_source():
    for (kind, layout), rule in ATTENTION_RULES.items():
        assert kind in ("cpu", "cuda") and layout in LAYOUTS
        assert rule.prefer and set(rule.prefer) <= set(ac.IMPLEMENTATIONS), (kind, layout)
        assert rule.source
        for impl in rule.prefer:  # every preference can run the layout it is listed for
            assert layout in ac._LAYOUTS[impl], (kind, layout, impl)
    assert {k for k, _ in ATTENTION_RULES} == {"cpu", "cuda"}
    assert all((k, layout) in ATTENTION_RULES for k in ("cpu", "cuda") for layout in LAYOUTS)
    # no flex attention on CPU: it has no backward there
    assert all("flex_attention" not in r.prefer for (k, _), r in ATTENTION_RULES.items()
               if k == "cpu")


def test_grpo_train_flag_offers_the_known_implementations():
    from grpo_train.checks import CHOICES

    assert CHOICES["attn_implementation"] == ("auto", *ac.IMPLEMENTATIONS)


@pytest.mark.parametrize("own", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_choice_is_sdpa_and_equals_the_padded_forward(own, layout):
    """Whatever the model was loaded with, the CPU rule picks sdpa (checked first when it is not
    the model's own), and its forwards on the layout's rows give the loss and gradients of the
    padded forward under the model's own implementation."""
    model = tiny_qwen(own)
    choice = choose_attention(model, layout)
    assert choice.implementation == "sdpa" and choice.device_kind == "cpu"
    assert choice.reason.startswith(f"rule cpu/{layout}: sdpa, eager (measured)")
    assert model.config._attn_implementation == own  # choosing changes nothing
    ids, attn, mask, T = grouped_batch()
    loss_pad, grads_pad = loss_and_grads(model, ids, attn, T, mask, RowLayout.PADDED)
    with using_attention(model, choice.implementation):
        assert model.config._attn_implementation == "sdpa"
        loss, grads = loss_and_grads(model, ids, attn, T, mask, layout)
    assert model.config._attn_implementation == own
    assert loss == pytest.approx(loss_pad, rel=1e-5, abs=1e-7)
    for n, g in grads_pad.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_unavailable_preference_is_skipped_with_its_reason(monkeypatch):
    monkeypatch.setitem(ATTENTION_RULES, ("cpu", RowLayout.SHARED),
                        AttentionRule(("flex_attention", "torch_varlen_flash", "eager"), "test"))
    choice = choose_attention(tiny_qwen("sdpa"), RowLayout.SHARED)
    assert choice.implementation == "eager"
    assert "skipped flex_attention: NotImplementedError" in choice.reason
    assert "backward on CPU" in choice.reason
    assert "torch_varlen_flash: it reads no attention mask" in choice.reason


def test_nothing_in_the_rule_runs_keeps_the_models_own(monkeypatch):
    monkeypatch.setitem(ATTENTION_RULES, ("cpu", RowLayout.PACKED),
                        AttentionRule((torch_varlen.NAME,), "test"))
    choice = choose_attention(tiny_qwen("eager"), RowLayout.PACKED)
    assert choice.implementation == "eager"
    assert choice.reason.startswith("the model's own: nothing in rule cpu/packed runs here")
    assert "varlen_attn runs on CUDA only" in choice.reason


def test_model_class_and_config_rule_out_implementations():
    model = tiny_qwen("eager")
    model._supports_sdpa = False  # a class without sdpa
    choice = choose_attention(model, RowLayout.PADDED)
    assert choice.implementation == "eager"
    assert "sdpa: Qwen2ForCausalLM does not support it (_supports_sdpa is False)" in choice.reason
    capped = tiny_qwen("eager", attn_logit_softcapping=50.0)  # as Gemma 2 configs carry
    choice = choose_attention(capped, RowLayout.PACKED)
    assert choice.implementation == "eager" and "soft-caps its attention logits" in choice.reason


def test_an_implementation_with_other_logits_is_refused(monkeypatch):
    """The forward check: an 'sdpa' that computes something else than the model's own eager
    attention is skipped with the size of the difference."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def off(module, q, k, v, mask, **kw):
        out, w = sdpa(module, q, k, v, mask, **kw)
        return out * 1.5, w

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", off)
    choice = choose_attention(tiny_qwen("eager"), RowLayout.PACKED)
    assert choice.implementation == "eager"
    assert "sdpa: its logits differ by" in choice.reason


def test_requested_implementation_is_checked_or_refused_by_name():
    model = tiny_qwen("sdpa")
    assert choose_attention(model, "packed", requested="eager").reason == "asked for"
    with pytest.raises(ValueError, match="'flex_attention' cannot run .* backward on CPU"):
        choose_attention(model, "shared", requested="flex_attention")
    with pytest.raises(ValueError, match="'torch_varlen_flash' cannot run .* shared rows .* "
                                         "reads no attention mask"):
        choose_attention(model, "shared", requested="torch_varlen_flash")
    with pytest.raises(ValueError, match="varlen_attn runs on CUDA only"):
        choose_attention(model, "packed", requested="torch_varlen_flash")
    with pytest.raises(ValueError, match="not one of sdpa, eager, flex_attention"):
        choose_attention(model, "packed", requested="flash_attention_9")
    with pytest.raises(ValueError, match="layout must be one of"):
        choose_attention(model, "rows")


def test_whole_model_callers_consider_only_generation_fit_implementations(monkeypatch):
    monkeypatch.setitem(ATTENTION_RULES, ("cpu", RowLayout.PACKED),
                        AttentionRule((torch_varlen.NAME, "eager"), "test"))
    choice = choose_attention(tiny_qwen("sdpa"), RowLayout.PACKED, scoped=False)
    assert choice.implementation == "eager"
    assert "the caller sets it for the whole model" in choice.reason


def test_a_model_own_implementation_the_rule_does_not_know_is_kept():
    model = tiny_qwen("sdpa")
    model.config._attn_implementation_internal = "kernels-community/flash-attn3"
    choice = choose_attention(model, RowLayout.PACKED)
    assert choice.implementation == "kernels-community/flash-attn3"
    assert "is not one the rule orders" in choice.reason


def test_using_attention_restores_every_config_and_skips_none():
    a, b = tiny_qwen("sdpa"), tiny_qwen("eager")
    with using_attention([a, None, b], "eager"):
        assert a.config._attn_implementation == b.config._attn_implementation == "eager"
    assert (a.config._attn_implementation, b.config._attn_implementation) == ("sdpa", "eager")
    with pytest.raises(RuntimeError, match="inside"):
        with using_attention(a, "eager"):
            raise RuntimeError("inside")
    assert a.config._attn_implementation == "sdpa"
    with using_attention(a, None):  # None: nothing changes
        assert a.config._attn_implementation == "sdpa"


def test_log_line_once_per_choice_and_reason(caplog):
    ac._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="grpo_kernels.hf.attention"):
        for _ in range(2):
            choose_attention(tiny_qwen("sdpa"), RowLayout.SHARED)
        choose_attention(tiny_qwen("sdpa"), RowLayout.PACKED)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_kernels.hf.attention"]
    assert lines == ["grpo_kernels: attention sdpa for shared rows on cpu: rule cpu/shared: "
                     "sdpa, eager (measured)",
                     "grpo_kernels: attention sdpa for packed rows on cpu: rule cpu/packed: "
                     "sdpa, eager (measured)"]


def test_log_line_once_in_a_fresh_process():
    """A fresh interpreter (no state from other tests): three choices of the same attention
    for the same layout on two models log one line."""
    script = textwrap.dedent("""
        import logging, sys, torch
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s|%(message)s")
        from transformers import Qwen2Config, Qwen2ForCausalLM
        from grpo_kernels.hf import choose_attention
        config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        for attn in ("sdpa", "sdpa", "eager"):
            config._attn_implementation = attn
            choose_attention(Qwen2ForCausalLM(config), "packed")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("grpo_kernels.hf.attention|")]
    assert lines == ["grpo_kernels.hf.attention|grpo_kernels: attention sdpa for packed rows on "
                     "cpu: rule cpu/packed: sdpa, eager (measured)"]


# ---- torch_varlen_flash's plumbing, with a reference kernel in place of PyTorch's -------------


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
    """varlen_attn's contract on [N, H, D] tensors: causal attention within each segment of
    cu_q (per-segment sdpa); records the dtypes it was given."""
    reference_varlen.dtypes.append(q.dtype)
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        seg = [x[a:b].transpose(0, 1) for x in (q, k, v)]  # [H, L, D]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            *seg, is_causal=is_causal, scale=scale).transpose(0, 1)
    return out


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """torch_varlen_flash with the reference kernel, allowed on the CPU."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    reference_varlen.dtypes = []
    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen)
    monkeypatch.setattr(ac, "_torch_refusal", lambda impl, device, training: None)
    return reference_varlen


def test_varlen_choice_runs_packed_rows_equal_to_padded(varlen_on_cpu, monkeypatch):
    monkeypatch.setitem(ATTENTION_RULES, ("cpu", RowLayout.PACKED),
                        AttentionRule((torch_varlen.NAME, "sdpa"), "test"))
    model = tiny_qwen("sdpa")
    choice = choose_attention(model, RowLayout.PACKED)
    assert choice.implementation == torch_varlen.NAME, choice.reason
    ids, attn, mask, T = grouped_batch()
    loss_pad, grads_pad = loss_and_grads(model, ids, attn, T, mask, RowLayout.PADDED)
    with using_attention(model, choice.implementation):
        rows = plan_rows(ids, attn, T, mask, RowLayout.PACKED, model.config)
        assert rows.input_ids.shape[0] == 1  # one row, handed its boundaries
        assert "cu_seq_lens_q" in row_inputs(rows, model.config)
        loss, grads = loss_and_grads(model, ids, attn, T, mask, RowLayout.PACKED)
    assert varlen_on_cpu.dtypes and loss == pytest.approx(loss_pad, rel=1e-5, abs=1e-7)
    for n, g in grads_pad.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_varlen_takes_the_autocast_dtype(varlen_on_cpu):
    """Float32 weights under bf16 autocast: rotary embeddings hand q and k over in float32;
    the kernel (16-bit only) gets all three in bf16."""
    model = tiny_qwen("sdpa")
    ids = torch.randint(1, 97, (1, 9))
    with using_attention(model, torch_varlen.NAME), torch.autocast("cpu", torch.bfloat16):
        model(input_ids=ids, use_cache=False)
    assert varlen_on_cpu.dtypes == [torch.bfloat16] * 2  # one call per layer
