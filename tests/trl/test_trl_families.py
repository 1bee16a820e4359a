"""grpo_kernels.trl.GRPOTrainer against TRL's own GRPOTrainer across model families, as a user
runs it: a tiny random model saved with its tokenizer, loaded by both trainers from the
directory. On a micro-batch of two prompts whose completions are apart (as TRL's shuffle leaves
them), the subclass logs the row layout its model allows, runs it (shared rows: one forward on
fewer positions than the padded batch) and gives TRL's loss, every gradient and every metric;
three training steps of the models that share prompts (OPT, Qwen3-MoE, DeepSeek V3, DBRX) end
with TRL's logs and parameters:

    family                 layout   why
    OPT                    shared   its 2-D mask handling mixes packed sequences; its own 4-D
                                    mask on shared rows does not
    Qwen3-MoE, aux off     shared   routing is per token (router_aux_loss_coef 0: TRL adds no
                                    auxiliary loss)
    Granite                shared   logits_scaling after the head
    Gemma 2                packed   a final-logit soft cap; sliding-window layers take no 4-D
                                    mask
    Falcon with ALiBi      packed   ALiBi biases are built from a 2-D mask
    Bloom                  padded   ALiBi, and eager attention over a packed row mixes sequences
    Gemma 3n               packed   sliding-window layers take no 4-D mask
    DeepSeek V3, DBRX      shared   routing is per token (no router_aux_loss_coef in their
                                    configs: TRL adds no auxiliary loss)

DeepSeek V2 with TRL's router_aux_loss_coef runs TRL's own implementation: its modeling module
has no load-balancing function of its own to reproduce.

(The MoE model with TRL's auxiliary loss on, packed rows, and GPT-2, padded for TRL's forward
without position_ids, are in test_trl_moe_vlm.py and test_trl_padding_free.py.)
"""

import logging

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
from test_trl_moe_vlm import assert_same_run, save_tiny_moe, train_both  # noqa: E402
from trl_harness import B, P, T, assert_same, make_batch, make_trainer  # noqa: E402

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.hf import RowLayout  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402
from grpo_train.tiny import build_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
# DeepSeek V2/V3: multi-head latent attention and a routed MoE after a dense first layer
_MLA_MOE = dict(_DECODER, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=32,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, n_group=1, topk_group=1)
# family -> (config class, model class, config keywords besides the vocabulary and token ids);
# no dropout anywhere, so that both trainers' training-mode forwards are the same function
FAMILIES = {
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        _DECODER, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.3)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _DECODER, head_dim=8, final_logit_softcapping=0.5, sliding_window=4)),
    "falcon-alibi": ("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
        hidden_dropout=0.0, attention_dropout=0.0)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(
        hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
    # per-layer token embeddings, AltUp, sliding-window layers, a final-logit soft cap
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
        _DECODER, head_dim=8, hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
        num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0],
        layer_types=["sliding_attention", "full_attention"], sliding_window=4,
        intermediate_size=[64, 64], final_logit_softcapping=0.5)),
    # the configs name no router_aux_loss_coef: TRL adds no auxiliary loss
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _MLA_MOE),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _MLA_MOE),
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
        attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2))),
}
# family -> (the layout logged, a phrase of its reason)
EXPECTED = {
    "opt": (RowLayout.SHARED, "packed rows refused: OPTForCausalLM"),
    "moe-no-aux": (RowLayout.SHARED, "each group's prompt once"),
    "granite": (RowLayout.SHARED, "each group's prompt once"),
    "gemma2": (RowLayout.PACKED, "sliding_attention"),
    "falcon-alibi": (RowLayout.PACKED, "ALiBi"),
    "bloom": (RowLayout.PADDED, "ALiBi"),
    "gemma3n": (RowLayout.PACKED, "sliding_attention"),
    "deepseek-v3": (RowLayout.SHARED, "each group's prompt once"),
    "dbrx": (RowLayout.SHARED, "each group's prompt once"),
}


def save_family(path: str, family: str) -> None:
    """A tiny random model of `family` and the tiny character tokenizer, in `path`."""
    if family == "moe-no-aux":
        save_tiny_moe(path, router_aux_loss_coef=0.0)
        return
    config_cls, model_cls, kwargs = FAMILIES[family]
    tok = build_tokenizer()
    torch.manual_seed(0)
    if family == "gemma3n":  # per-layer embeddings for the tokenizer's ids (default: 262,144)
        kwargs = dict(kwargs, vocab_size_per_layer_input=len(tok))
    config = getattr(transformers, config_cls)(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, **kwargs)
    model = getattr(transformers, model_cls)(config)
    if family == "gemma3n":
        # a padding embedding that is not 0: on a zero first hidden state the model's own
        # gradient is NaN (AltUp's RMS magnitude mean(h²) ** 0.5), in TRL's trainer too
        with torch.no_grad():
            for embed in (model.get_input_embeddings(), model.model.embed_tokens_per_layer):
                embed.weight[tok.pad_token_id].normal_(0.0, 0.02)
    model.save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    dirs = {}

    def get(family):
        if family not in dirs:
            dirs[family] = str(tmp_path_factory.mktemp(family))
            save_family(dirs[family], family)
        return dirs[family]

    return get


class PositionCount:
    """The input positions of every forward of a trainer's model body."""

    def __init__(self, model):
        self.counts: list[int] = []
        body = model.get_decoder()
        self.handle = body.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.counts.append(ids.numel())


@pytest.mark.parametrize("cfg", [dict(loss_type="dapo", beta=0.04),
                                 dict(loss_type="grpo", entropy_coef=0.05)],
                         ids=["dapo-kl", "grpo-entropy"])
@pytest.mark.parametrize("family", list(EXPECTED))
def test_family_layout_and_compute_loss_equal_trl(family_dirs, family, cfg, caplog):
    model_dir = family_dirs(family)
    with caplog.at_level(logging.INFO, logger="grpo_kernels.trl.trainer"):
        ref, ours = (make_trainer(cls, model_dir, **cfg) for cls in (trl.GRPOTrainer,
                                                                     GRPOTrainer))
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_kernels.trl.trainer"]
    layout, why = EXPECTED[family]
    assert ours._layout is layout and ours._support.fallback is None
    assert not ref.aux_loss_enabled
    assert len(lines) == 1 and f"run {layout} rows" in lines[0] and why in lines[0], lines
    count = PositionCount(ours.model)
    _both_losses(ref, ours)
    count.handle.remove()
    assert len(count.counts) == 1  # one forward of the micro-batch, as TRL's
    if layout is RowLayout.PADDED:
        assert count.counts == [B * (P + T)]
    else:
        assert count.counts[0] <= B * (P + T)


@pytest.mark.parametrize("family", ["opt", "moe-no-aux", "deepseek-v3", "dbrx"])
def test_family_training_run_equals_trl(family_dirs, family):
    """Three SGD steps (generation, shared-row scoring of the old and reference policies, the
    loss; gradient accumulation 2): every logged number and the parameters are TRL's."""
    model_dir = family_dirs(family)
    ref, ours = train_both(model_dir, loss_type="dapo", beta=0.04)
    assert ours._layout is RowLayout.SHARED
    assert_same_run(ref, ours, model_dir)


def test_moe_whose_auxiliary_loss_is_not_known_runs_trls_own(family_dirs, caplog):
    """DeepSeek V2 with TRL's router_aux_loss_coef: its modeling module has no
    load_balancing_loss_func, so the subclass says so in its one line and runs TRL's own
    implementation (padded rows): TRL's loss, gradients and aux_loss metric."""
    model_dir = family_dirs("deepseek-v2")
    cfg = dict(loss_type="dapo", beta=0.04, router_aux_loss_coef=0.01)
    with caplog.at_level(logging.INFO, logger="grpo_kernels.trl.trainer"):
        ref, ours = (make_trainer(cls, model_dir, **cfg) for cls in (trl.GRPOTrainer,
                                                                     GRPOTrainer))
    assert ref.aux_loss_enabled and ours._layout is RowLayout.PADDED
    assert "load_balancing_loss_func" in ours._support.fallback
    assert any("TRL's own implementation" in r.getMessage() for r in caplog.records)
    _both_losses(ref, ours)
    assert ours._metrics["train"]["aux_loss"][-1] > 0


def _both_losses(ref, ours) -> None:
    """One micro-batch (accumulation 2) through TRL's _compute_loss and ours, backward on both:
    loss, gradients and metrics equal (`assert_same`)."""
    for tr in (ref, ours):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
    # prompts 0 and 2, each twice, apart: shared rows hold each once
    inputs = make_batch(ref, prompt_rows=torch.tensor([0, 2, 0, 2]))
    loss_ref = ref._compute_loss(ref.model, inputs)
    loss_ref.backward()
    with force_backend("chunked"):
        loss = ours._compute_loss(ours.model, inputs)
        loss.backward()
    assert_same(ref, ours, loss_ref, loss)
