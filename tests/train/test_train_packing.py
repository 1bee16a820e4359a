"""Padding-free micro-batches: `grpo_kernels.hf.pack_sequences` and the packed form of the
Hugging Face entry points equal the padded batch (loss, every gradient, metrics, log-probs), bad
packed inputs are refused, the packed-attention check catches a model that attends across
sequences, and a packed trainer step equals the padded one, also with token-budget
micro-batches of unequal sizes."""

import types

import pytest
import torch
from test_train_loop import step_record, tiny_cfg
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_kernels import FusedLinearGRPOLoss
from grpo_kernels.hf import (
    causal_lm_grpo_loss,
    causal_lm_logprobs,
    check_packed_attention,
    pack_sequences,
)
from grpo_kernels.hf.packed_rows import FULL_PRECISION_ATOL, HALF_PRECISION_ATOL, agreement_atol
from grpo_train import batching, train
from grpo_train import models as models_mod
from grpo_train import trainer as trainer_mod

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_qwen(attn="sdpa", seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation=attn)
    return Qwen2ForCausalLM(config).float()


def padded_batch(S=5, Lp=5, T=6, seed=1):
    """Left-padded prompts, EOS-style completion masks of every kind: full, partial, length 1,
    and all zero (a masked truncated completion)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (S, Lp + T), generator=g)
    attn = torch.ones(S, Lp + T, dtype=torch.long)
    attn[0, :2] = 0
    attn[1, :1] = 0
    lengths = torch.tensor([3, T, 0, 1, 5])[:S]
    mask = (torch.arange(T) < lengths[:, None]).long()
    attn[:, Lp:] = mask
    return ids, attn, mask, T


def test_pack_sequences_layout():
    ids, attn, mask, T = padded_batch()
    pk = pack_sequences(ids, attn, T, mask)
    R, W = pk.input_ids.shape
    assert W % 16 == 0 and pk.position_ids.shape == (R, W)
    assert pk.real_tokens == int(attn.sum()) and pk.cu_seqlens.tolist() == [0, 3, 9, 9, 10, 15]
    flat_ids, flat_pos = pk.input_ids.reshape(-1), pk.position_ids.reshape(-1)
    # each kept completion token is predicted from the position before it, in order
    assert torch.equal(flat_ids[pk.logits_to_keep + 1], ids[:, -T:][mask.bool()])
    for s in range(ids.shape[0]):  # the sequence's real tokens, positions 0, 1, ...
        real = ids[s][attn[s].bool()]
        tokens = pk.logits_to_keep[pk.cu_seqlens[s]:pk.cu_seqlens[s + 1]] + 1
        if len(tokens):
            start = int(tokens[-1]) - (len(real) - 1)
            assert torch.equal(flat_ids[start:start + len(real)], real)
            assert flat_pos[start:start + len(real)].tolist() == list(range(len(real)))
    x = torch.randn(ids.shape[0], T)
    assert torch.equal(pk.unpack(pk.pack(x)), x * mask)
    # the real-token mask: every real token, in each row's head, and no filler
    real = pk.real_mask()
    assert real.shape == (R, W) and int(real.sum()) == pk.real_tokens
    assert torch.equal(real, real.cummin(dim=1).values)  # 1s then 0s per row
    assert sorted(flat_ids[real.reshape(-1).bool()].tolist()) == sorted(ids[attn.bool()].tolist())


@pytest.mark.parametrize("bad, match", [
    (dict(completion_mask=torch.tensor([[1, 0, 1]] * 2)), "prefix"),
    (dict(row_width=3), "row_width"),
    (dict(logits_to_keep=5), "logits_to_keep"),
])
def test_pack_sequences_refuses_bad_input(bad, match):
    ids = torch.randint(1, 9, (2, 5))
    attn = torch.ones(2, 5, dtype=torch.long)
    kwargs = {"logits_to_keep": 3, **bad}
    with pytest.raises(ValueError, match=match):
        pack_sequences(ids, attn, **kwargs)
    attn[0, :2] = 0  # no prompt token at all
    with pytest.raises(ValueError, match="prompt token"):
        pack_sequences(ids, attn, 3)


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_packed_causal_lm_loss_equals_padded(loss_type, level, one_row):
    model = tiny_qwen()
    ids, attn, mask, T = padded_batch()
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(ids.shape[0], generator=g)
    old = -3 + 0.1 * torch.randn(ids.shape[0], T, generator=g)
    ref = -3 + 0.1 * torch.randn(ids.shape[0], T, generator=g)
    fn = FusedLinearGRPOLoss(beta=0.1, loss_type=loss_type, max_completion_length=T,
                             importance_sampling_level=level, entropy_coef=0.01)
    loss_pad, met_pad = causal_lm_grpo_loss(model, ids, attn, T, adv, mask.float(), old, ref,
                                            loss_fn=fn, position_ids=pos)
    loss_pad.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    width = int(attn.sum()) if one_row else None
    pk = pack_sequences(ids, attn, T, mask, row_width=width)
    assert pk.input_ids.shape[0] == 1 or not one_row
    loss_pk, met_pk = causal_lm_grpo_loss(model, pk.input_ids, None, pk.logits_to_keep, adv,
                                          None, pk.pack(old), pk.pack(ref), loss_fn=fn,
                                          cu_seqlens=pk.cu_seqlens, position_ids=pk.position_ids)
    loss_pk.backward()
    assert loss_pk.item() == pytest.approx(loss_pad.item(), rel=1e-5, abs=1e-7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert met_pk.keys() == met_pad.keys()
    for k in met_pad:
        torch.testing.assert_close(met_pk[k], met_pad[k], rtol=1e-5, atol=1e-6, msg=k)
    lp_pad = causal_lm_logprobs(model, ids, attn, T, position_ids=pos)
    lp_pk = causal_lm_logprobs(model, pk.input_ids, None, pk.logits_to_keep,
                               position_ids=pk.position_ids, batch_size=1)
    torch.testing.assert_close(lp_pk, pk.pack(lp_pad), rtol=1e-5, atol=1e-5)


def test_packed_entry_points_refuse_bad_input():
    model = tiny_qwen()
    ids, attn, mask, T = padded_batch()
    pk = pack_sequences(ids, attn, T, mask)
    adv = torch.zeros(ids.shape[0])
    call = dict(loss_fn=FusedLinearGRPOLoss(), position_ids=pk.position_ids)
    with pytest.raises(ValueError, match="attention_mask=None"):
        causal_lm_grpo_loss(model, pk.input_ids, torch.ones_like(pk.input_ids),
                            pk.logits_to_keep, adv, cu_seqlens=pk.cu_seqlens, **call)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_lm_grpo_loss(model, pk.input_ids, None, pk.logits_to_keep, adv, **call)
    with pytest.raises(ValueError, match="cu_seqlens is for packed rows"):
        causal_lm_grpo_loss(model, ids, attn, T, adv, cu_seqlens=pk.cu_seqlens, **call)
    W = pk.input_ids.shape[1]
    last_column = torch.tensor([W - 1])
    with pytest.raises(ValueError, match="last column"):
        causal_lm_logprobs(model, pk.input_ids, None, last_column, position_ids=pk.position_ids)


def test_packed_attention_check():
    assert check_packed_attention(tiny_qwen("sdpa")) is None
    assert check_packed_attention(tiny_qwen("eager")) is None

    class SeesEverything(torch.nn.Module):
        """Attends over the whole row (a running mean), ignoring position_ids."""

        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(vocab_size=11, _attn_implementation="custom")
            self.emb = torch.nn.Embedding(11, 4)

        def forward(self, input_ids, position_ids=None, use_cache=False):
            x = self.emb(input_ids).cumsum(dim=1)
            return types.SimpleNamespace(logits=x / torch.arange(1, x.shape[1] + 1)[:, None])

    reason = check_packed_attention(SeesEverything())
    assert reason is not None and "attends across" in reason and "'custom'" in reason


class PerSequenceMean(torch.nn.Module):
    """Attends within each sequence (a running mean restarting where position_ids restart);
    a packed row's logits carry `noise` (relative to the largest), as a kernel of its own for
    packed rows carries its rounding; `leak` attends over the whole row instead."""

    def __init__(self, dtype, noise=0.0, leak=False):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=11, _attn_implementation=f"n{noise}{leak}")
        self.emb = torch.nn.Embedding(11, 4, dtype=dtype)
        self.noise, self.leak = noise, leak

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.emb(input_ids).float()
        pos = torch.arange(x.shape[1])[None] if position_ids is None else position_ids
        seg = (pos == 0).cumsum(dim=1) if not self.leak else torch.zeros_like(pos)
        same = (seg[:, :, None] == seg[:, None, :]) & torch.ones(
            x.shape[1], x.shape[1], dtype=torch.bool).tril()
        y = (same.float() @ x) / same.sum(-1, keepdim=True)
        if position_ids is not None:  # the packed forward
            y = y + self.noise * y.abs().max() * torch.linspace(-1, 1, y.numel()).view(y.shape)
        return types.SimpleNamespace(logits=y.to(x.dtype))


def test_packed_check_bound_follows_the_precision():
    """Half precision: a packed row within bf16's rounding of separate forwards passes (varlen
    flash on the GPU is such a kernel), a leak does not; float32 keeps the tight bound."""
    assert check_packed_attention(PerSequenceMean(torch.float32)) is None
    assert check_packed_attention(PerSequenceMean(torch.bfloat16, noise=0.02)) is None
    assert "attends across" in check_packed_attention(PerSequenceMean(torch.float32, noise=0.02))
    assert "attends across" in check_packed_attention(
        PerSequenceMean(torch.bfloat16, noise=0.02, leak=True))
    fp32 = PerSequenceMean(torch.float32, noise=0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as `--bf16` runs the checks
        assert agreement_atol(fp32) == HALF_PRECISION_ATOL
    assert agreement_atol(fp32) == FULL_PRECISION_ATOL


def test_cut_and_split_micro_batches():
    assert batching.cut([5, 5, 5, 5], 2, 0) == [slice(0, 2), slice(2, 4)]
    assert batching.cut([4, 9, 3, 3, 2], 0, 8) == [slice(0, 1), slice(1, 2), slice(2, 5)]
    chunks = batching.split_to([slice(0, 1), slice(1, 5)], 4)  # contiguous, none empty
    assert chunks == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 5)]
    with pytest.raises(ValueError):
        batching.split_to([slice(0, 1)], 2)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_packed_trainer_step_equals_padded(tmp_path, loss_type):
    """The same step (same seed, so the same completions) with padded rows, packed rows, and
    packed rows cut into unequal token-budget micro-batches."""
    runs = {"padded": dict(padding_free=False),
            "packed": dict(padding_free=True, share_prompt=False),
            "budget": dict(padding_free=True, share_prompt=False, max_tokens_per_microbatch=24),
            "shared": dict(padding_free=True, share_prompt=True),
            "shared_budget": dict(padding_free=True, share_prompt=True,
                                  max_tokens_per_microbatch=24)}
    got = {}
    for name, options in runs.items():
        cfg = tiny_cfg(tmp_path / name, steps=1, loss_type=loss_type, beta=0.1,
                       max_grad_norm=0.0, mask_truncated_completions=True, **options)
        result = train(cfg)
        got[name] = (step_record(cfg, 1), {k: v.detach().clone()
                                           for k, v in result["model"].state_dict().items()})
    base, base_params = got["padded"]
    assert base["grad_norm"] > 0
    for name in ("packed", "budget", "shared", "shared_budget"):
        rec, params = got[name]
        for key in ("loss", "grad_norm", "entropy", "kl", "clip_ratio/region_mean", "reward"):
            assert rec[key] == pytest.approx(base[key], rel=1e-5, abs=1e-7), (name, key)
        # one AdamW step on equal gradients: equal parameters, to 1% of the step (lr 1e-3):
        # AdamW divides by |g|, which magnifies float32 rounding where a gradient is near 0
        for k in base_params:
            torch.testing.assert_close(params[k], base_params[k], rtol=1e-5, atol=1e-5)


def test_micro_batch_gradients_equal_across_forms(tmp_path):
    """Every parameter's gradient of a generated batch: padded in one micro-batch, packed in
    one, and packed under a token budget (weighted by each micro-batch's share of sequences)."""
    from grpo_kernels.params import GRPOParams
    from grpo_train.models import build_embedded

    cfg = tiny_cfg(tmp_path, tiny_hidden_size=32)
    model, _tok = build_embedded(cfg)
    ids, attn, mask, T = padded_batch(S=5)
    batch = dict(input_ids=ids, attention_mask=attn, completion_mask=mask, T=T)
    batch["input_ids"] = batch["input_ids"] % model.config.vocab_size
    adv = torch.randn(5, generator=torch.Generator().manual_seed(3))
    loss_fn = FusedLinearGRPOLoss(params=GRPOParams(loss_type="grpo", beta=0.0))
    grads = {}
    batch_groups = dict(batch, input_ids=batch["input_ids"].clone(),
                        attention_mask=batch["attention_mask"].clone())
    batch_groups["input_ids"][1:3, :-T] = batch_groups["input_ids"][0, :-T]  # a group of 3
    batch_groups["attention_mask"][1:3, :-T] = batch_groups["attention_mask"][0, :-T]
    for name, (layout, budget) in {"padded": ("padded", 0), "packed": ("packed", 0),
                                   "budget": ("packed", 14), "shared": ("shared", 0),
                                   "shared_budget": ("shared", 14)}.items():
        model.zero_grad()
        shared = layout == "shared"
        mbs = batching.micro_batches(batch_groups if shared else batch, layout, 0, budget)
        assert (len(mbs) > 1) == (budget > 0)
        for mb in mbs:
            loss, _ = trainer_mod._loss(model, loss_fn, mb, adv[mb.seqs], None, None, None,
                                        "fused", {})
            (loss * mb.num_seqs / 5).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()  # the padded reference of the batch with a group
    mb, = batching.micro_batches(batch_groups, "padded", 0, 0)
    loss, _ = trainer_mod._loss(model, loss_fn, mb, adv, None, None, None, "fused", {})
    loss.backward()
    grads["padded_groups"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name in ("packed", "budget", "shared", "shared_budget"):
        base = grads["padded_groups" if name.startswith("shared") else "padded"]
        for n, g in base.items():
            torch.testing.assert_close(grads[name][n], g, rtol=1e-4, atol=1e-7, msg=(name, n))


def test_unsupported_model_falls_back_with_one_line(monkeypatch, capsys):
    said = []
    from grpo_kernels.hf import row_plan

    monkeypatch.setattr(row_plan, "check_packed_attention", lambda m: "it attends across")
    cfg = types.SimpleNamespace(padding_free=True)
    assert models_mod.micro_batch_layout(object(), cfg, said.append) == "padded"
    assert said == ["micro-batches: padded rows, not packed: it attends across "
                    "(--padding_free)"]


def test_absolute_position_model_still_packs():
    """grpo_train's padded forward passes cumsum(mask) - 1 positions, so a model with learned
    absolute position embeddings (GPT-2) keeps packed and shared rows: its packed log-probs equal
    the padded ones on left-padded prompts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=64, bos_token_id=1, eos_token_id=1)).eval()
    said = []
    cfg = types.SimpleNamespace(padding_free=True, share_prompt=True)
    assert models_mod.micro_batch_layout(model, cfg, said.append) == "shared"
    ids, attn, mask, T = padded_batch()
    lp_pad = causal_lm_logprobs(model, ids, attn, T, position_ids=models_mod.position_ids(attn))
    pk = pack_sequences(ids, attn, T, mask)
    lp_pk = causal_lm_logprobs(model, pk.input_ids, None, pk.logits_to_keep,
                               position_ids=pk.position_ids)
    torch.testing.assert_close(lp_pk, pk.pack(lp_pad), rtol=1e-5, atol=1e-5)
