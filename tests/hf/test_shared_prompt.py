"""Shared-prefix rows (`grpo_kernels.hf.share_prompts`): the layout, the mask, exactness
against the padded batch (loss, every gradient, metrics, log-probs) for every loss type and IS
level, beta 0 / 0.04, the entropy bonus and a LoRA head, the refusals, and the flash boundaries
of packed rows checked against the padded computation. The GPU tests at the end run flex
attention's BlockMask and a real flash varlen kernel."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_kernels import LOSS_TYPES, FusedLinearGRPOLoss
from grpo_kernels.hf import (
    add_lora,
    causal_lm_grpo_loss,
    causal_lm_logprobs,
    check_shared_prompt,
    pack_sequences,
    share_prompts,
)
from grpo_kernels.hf.shared_prompt import _allowed_blocks, prompt_groups

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_qwen(attn="sdpa", seed=0, **extra):
    torch.manual_seed(seed)
    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    config = Qwen2Config(**{**sizes, **extra}, attn_implementation=attn)
    return Qwen2ForCausalLM(config).float()


def grouped_batch(prompt_lengths=(5, 7, 2), G=3, T=6, seed=1):
    """len(prompt_lengths) groups of G sequences: left-padded prompts equal within a group,
    completions of every kind (full, partial, one token, none)."""
    g = torch.Generator().manual_seed(seed)
    Lp, S = max(prompt_lengths), len(prompt_lengths) * G
    ids = torch.randint(1, 97, (S, Lp + T), generator=g)
    attn = torch.ones(S, Lp + T, dtype=torch.long)
    for k, n in enumerate(prompt_lengths):
        rows = slice(k * G, (k + 1) * G)
        ids[rows, :Lp] = ids[k * G, :Lp]
        attn[rows, :Lp - n] = 0
    kept = torch.tensor([T, 2, 0, 1, T, 4, 3, T, 5][:S])
    mask = (torch.arange(T) < kept[:, None]).long()
    attn[:, Lp:] = mask
    return ids, attn, mask, T


def positions_of(attn):
    return (attn.cumsum(1) - 1).clamp(min=0)


def test_layout_holds_each_prompt_once():
    ids, attn, mask, T = grouped_batch()
    sh = share_prompts(ids, attn, T, mask)
    assert prompt_groups(ids, attn, T) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # each prompt once, plus the last prompt token at the head of each of its G segments
    prompts = [5, 7, 2]
    assert sh.real_tokens == sum(p - 1 for p in prompts) + 9 + int(mask.sum())
    flat_ids, flat_pos = sh.input_ids.reshape(-1), sh.position_ids.reshape(-1)
    assert torch.equal(flat_ids[sh.logits_to_keep + 1], ids[:, -T:][mask.bool()])
    for s in range(9):  # the kept tokens continue the prompt's positions
        kept = sh.logits_to_keep[sh.cu_seqlens[s]:sh.cu_seqlens[s + 1]] + 1
        p = prompts[s // 3]
        assert flat_pos[kept].tolist() == list(range(p, p + len(kept)))
    x = torch.randn(9, T)
    assert torch.equal(sh.unpack(sh.pack(x)), x * mask)
    m = sh.attention_mask  # [R, 1, W, W] bool: causal, and no segment sees a sibling
    assert m.dtype == torch.bool and m.shape[1] == 1
    assert not bool(torch.triu(m[:, 0].float(), diagonal=1).any())
    doc, prefix_of = sh.segments
    first, second = sh.logits_to_keep[0].item(), sh.logits_to_keep[6].item()  # seqs 0 and 1
    W = sh.input_ids.shape[1]
    assert doc.reshape(-1)[first] != doc.reshape(-1)[second]
    assert not bool(m.reshape(-1, W, W)[second // W, second % W, first % W])


def _mask_by_rule(doc, prefix_of):
    """The rule, position pair by position pair: k <= q and k's segment is q's or q's prefix."""
    R, W = doc.shape
    k, q = torch.arange(W).view(1, W), torch.arange(W).view(W, 1)
    sees = (doc.unsqueeze(1) == doc.unsqueeze(2)) | (doc.unsqueeze(1) == prefix_of.unsqueeze(2))
    return (sees & (k <= q)).unsqueeze(1)


def test_block_written_mask_equals_the_rule_on_random_layouts():
    """The mask is written block by block (`_allowed_blocks`); on random rows of segments, some
    with a prefix segment earlier in the row, it equals the pairwise rule."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        R, W = 3, 40
        doc = torch.empty(R, W, dtype=torch.long)
        prefix_of = torch.full((R, W), -1)
        segment = 0
        for r in range(R):
            at, prefix = 0, None
            while at < W:
                n = min(int(torch.randint(1, 9, (1,), generator=g)), W - at)
                doc[r, at:at + n] = segment
                if prefix is not None and torch.rand(1, generator=g) < 0.6:
                    prefix_of[r, at:at + n] = prefix
                elif torch.rand(1, generator=g) < 0.5:
                    prefix = segment
                segment, at = segment + 1, at + n
        assert torch.equal(_allowed_blocks(doc, prefix_of), _mask_by_rule(doc, prefix_of))
    ids, attn, mask, T = grouped_batch()  # and on a real layout
    rows = share_prompts(ids, attn, T, mask)
    assert torch.equal(rows.attention_mask, _mask_by_rule(*rows.segments))


def test_groups_are_equal_prompts_wherever_they_are():
    ids, attn, mask, T = grouped_batch()
    ids[1, -T - 1] = (ids[1, -T - 1] + 1) % 97  # sequence 1's prompt differs at its last token
    assert prompt_groups(ids, attn, T)[:2] == [[0, 2], [1]]
    order = torch.tensor([4, 0, 8, 3, 1, 6, 2, 5, 7])  # a shuffled batch
    assert prompt_groups(ids[order], attn[order], T) == [[0, 3, 7], [1, 6], [2, 5, 8], [4]]


def test_shuffled_batch_shares_and_equals_padded():
    model = tiny_qwen()
    ids, attn, mask, T = grouped_batch()
    order = torch.tensor([4, 0, 8, 3, 1, 6, 2, 5, 7])
    ids, attn, mask = ids[order], attn[order], mask[order]
    sh = share_prompts(ids, attn, T, mask, model_config=model.config)
    assert sh.real_tokens < int(attn.sum())  # prompts computed once
    lp_pad = causal_lm_logprobs(model, ids, attn, T, position_ids=positions_of(attn))
    lp_sh = causal_lm_logprobs(model, sh.input_ids, sh.attention_mask, sh.logits_to_keep,
                               position_ids=sh.position_ids)
    torch.testing.assert_close(lp_sh, sh.pack(lp_pad), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_one_token_prompt_has_an_empty_prefix(attn_impl):
    """A group whose prompt is one token has no prefix segment (its segments start with that
    token): the rows build, and the log-probs equal the padded ones."""
    model = tiny_qwen(attn_impl)
    ids, attn, mask, T = grouped_batch(prompt_lengths=(1, 3), G=2)
    sh = share_prompts(ids, attn, T, mask, model_config=model.config)
    lp_pad = causal_lm_logprobs(model, ids, attn, T, position_ids=positions_of(attn))
    lp_sh = causal_lm_logprobs(model, sh.input_ids, sh.attention_mask, sh.logits_to_keep,
                               position_ids=sh.position_ids)
    torch.testing.assert_close(lp_sh, sh.pack(lp_pad), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_shared_loss_equals_padded(attn_impl, loss_type, level, beta):
    model = tiny_qwen(attn_impl)
    ids, attn, mask, T = grouped_batch()
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(ids.shape[0], generator=g)
    old = -3 + 0.1 * torch.randn(ids.shape[0], T, generator=g)
    ref = -3 + 0.1 * torch.randn(ids.shape[0], T, generator=g)
    fn = FusedLinearGRPOLoss(beta=beta, loss_type=loss_type, max_completion_length=T,
                             importance_sampling_level=level, entropy_coef=0.01)
    loss_pad, met_pad = causal_lm_grpo_loss(model, ids, attn, T, adv, mask.float(), old, ref,
                                            loss_fn=fn, position_ids=positions_of(attn))
    loss_pad.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sh = share_prompts(ids, attn, T, mask, model_config=model.config)
    loss_sh, met_sh = causal_lm_grpo_loss(model, sh.input_ids, sh.attention_mask,
                                          sh.logits_to_keep, adv, None, sh.pack(old),
                                          sh.pack(ref), loss_fn=fn, cu_seqlens=sh.cu_seqlens,
                                          position_ids=sh.position_ids)
    loss_sh.backward()
    assert loss_sh.item() == pytest.approx(loss_pad.item(), rel=1e-5, abs=1e-7)
    assert any(g.abs().sum() > 0 for g in grads.values())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for k in met_pad:
        torch.testing.assert_close(met_sh[k], met_pad[k], rtol=1e-5, atol=1e-6, msg=k)


def test_shared_logprobs_and_lora_head_equal_padded():
    model = add_lora(tiny_qwen(), r=4, target_modules=["q_proj", "v_proj", "lm_head"])
    ids, attn, mask, T = grouped_batch()
    sh = share_prompts(ids, attn, T, mask, model_config=model.config)
    lp_pad = causal_lm_logprobs(model, ids, attn, T, position_ids=positions_of(attn))
    lp_sh = causal_lm_logprobs(model, sh.input_ids, sh.attention_mask, sh.logits_to_keep,
                               position_ids=sh.position_ids)
    torch.testing.assert_close(lp_sh, sh.pack(lp_pad), rtol=1e-5, atol=1e-5)
    adv = torch.randn(ids.shape[0])
    fn = FusedLinearGRPOLoss(beta=0.0)
    losses, grads = [], []
    for args in [(ids, attn, T, adv, mask.float()),
                 (sh.input_ids, sh.attention_mask, sh.logits_to_keep, adv, None)]:
        kw = dict(cu_seqlens=sh.cu_seqlens, position_ids=sh.position_ids) if args[4] is None \
            else dict(position_ids=positions_of(attn))
        loss, _ = causal_lm_grpo_loss(model, *args, loss_fn=fn, **kw)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        model.zero_grad()
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    assert any("lm_head" in n and g.abs().sum() > 0 for n, g in grads[0].items())
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("config_extra, match", [
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), "layers of kind"),
    (dict(attn_implementation="flash_attention_2"), "takes no 4-D mask"),
])
def test_check_shared_prompt_refuses(config_extra, match):
    attn = config_extra.pop("attn_implementation", "sdpa")
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="sdpa", **config_extra)
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = attn  # set after loading: no flash_attn package needed
    reason = check_shared_prompt(model)
    assert reason is not None and match in reason


def test_check_shared_prompt_accepts_dense():
    assert check_shared_prompt(tiny_qwen("sdpa")) is None
    assert check_shared_prompt(tiny_qwen("eager")) is None


def test_moe_shares_prompts_unless_an_aux_loss_is_added():
    """A Mixture-of-Experts model routes each token alone: its shared-prefix logits equal
    separate forwards' (the check passes) and it takes shared rows; a caller that adds the
    auxiliary load-balancing loss over the rows' tokens (TRL's aux_loss_enabled) gets packed
    rows, since sharing would count each prompt once."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from grpo_kernels.hf import RowLayout, choose_layout

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None, attn_implementation="sdpa"))
    assert check_shared_prompt(model) is None
    assert choose_layout(model).layout is RowLayout.SHARED
    choice = choose_layout(model, aux_loss=True)
    assert choice.layout is RowLayout.PACKED and "auxiliary loss" in choice.reason


def test_share_prompts_refuses_bad_input():
    ids, attn, mask, T = grouped_batch()
    with pytest.raises(ValueError, match="prefix"):
        share_prompts(ids, attn, T, mask.flip(1))
    with pytest.raises(ValueError, match="logits_to_keep"):
        share_prompts(ids, attn, ids.shape[1], mask)
    config = Qwen2Config()
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="4-D mask"):
        share_prompts(ids, attn, T, mask, model_config=config)


def _recording_flash(record: list):
    """An attention function that reads only the boundaries it is handed (cu_seq_lens_q/k,
    max_length_q/k), attends within each segment with sdpa and records them: packed rows'
    outputs equal the padded ones only if those boundaries are right."""
    import torch.nn.functional as F

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        cu, longest = kw["cu_seq_lens_q"], kw["max_length_q"]
        record.append((cu.clone(), kw["cu_seq_lens_k"].clone(), longest, kw["max_length_k"]))
        B, H, L, D = query.shape
        q, k, v = (x.transpose(1, 2).reshape(B * L, x.shape[1], D) for x in (query, key, value))
        out = torch.empty_like(q)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert b - a <= longest
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                               v[a:b].transpose(0, 1), is_causal=True,
                                               scale=scaling, enable_gqa=True)
            out[a:b] = o.transpose(0, 1)
        return out.reshape(B, L, H, D), None

    return attend


def test_flash_boundaries_of_packed_rows_equal_padded():
    from transformers import AttentionInterface

    from grpo_train import batching

    record = []
    AttentionInterface.register("flash_recording", _recording_flash(record))
    model = tiny_qwen("sdpa")
    ids, attn, mask, T = grouped_batch()
    lp_pad = causal_lm_logprobs(model, ids, attn, T, position_ids=positions_of(attn))
    model.config._attn_implementation = "flash_recording"  # "flash" in the name: one row
    batch = dict(input_ids=ids, attention_mask=attn, completion_mask=mask, T=T)
    mb, = batching.micro_batches(batch, "packed", 0, 0, model_config=model.config)
    assert mb.packed.input_ids.shape[0] == 1 and set(mb.boundaries) == {
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    lp = causal_lm_logprobs(model, *mb.inputs, **mb.model_kwargs)
    assert record, "the attention function never ran"
    lengths = attn.sum(dim=1).tolist()  # every sequence is a segment of its own length
    cu, cu_k, longest, _ = record[-1]
    assert torch.equal(cu, cu_k) and sorted(cu.diff().tolist()) == sorted(lengths)
    assert longest == max(lengths)
    torch.testing.assert_close(lp, mb.packed.pack(lp_pad), rtol=1e-5, atol=1e-5)
    # several rows with their filler tails: the boundaries mark every segment
    pk = pack_sequences(ids, attn, T, mask, row_width=32)
    assert pk.input_ids.shape[0] > 1
    lp = causal_lm_logprobs(model, pk.input_ids, None, pk.logits_to_keep,
                            position_ids=pk.position_ids, **pk.boundaries())
    torch.testing.assert_close(lp, pk.pack(lp_pad), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="4-D attention_mask"):
        share_prompts(ids, attn, T, mask).boundaries()


# ---- on a CUDA device: flex attention's BlockMask and a real flash varlen kernel --------------


def _loss_and_grads(model, args, beta=0.04, **kw):
    loss, metrics = causal_lm_grpo_loss(model, *args, loss_fn=FusedLinearGRPOLoss(beta=beta),
                                        **kw)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _long_groups(device):
    """Two groups of 4 with prompts of 300 and 200 tokens and completions of 37-260: rows
    wider than flex attention's 128-position blocks, so sibling blocks are skipped."""
    g = torch.Generator().manual_seed(5)
    Lp, T, S = 300, 260, 8
    ids = torch.randint(1, 97, (S, Lp + T), generator=g)
    attn = torch.ones(S, Lp + T, dtype=torch.long)
    ids[:4, :Lp] = ids[0, :Lp]
    ids[4:, :Lp] = ids[4, :Lp]
    attn[4:, :100] = 0
    mask = (torch.arange(T) < torch.tensor([260, 37, 150, 90, 200, 260, 64, 120])[:, None]).long()
    attn[:, Lp:] = mask
    return ids.to(device), attn.to(device), mask.to(device), T


@pytest.mark.gpu
def test_flex_block_mask_shared_equals_padded_on_gpu():
    model = tiny_qwen("sdpa", hidden_size=64, intermediate_size=128).cuda()  # head_dim 16
    ids, attn, mask, T = _long_groups("cuda")
    adv = torch.linspace(-1, 1, ids.shape[0], device="cuda")
    ref = -3 + 0.1 * torch.randn(ids.shape[0], T, device="cuda")
    loss_pad, grads_pad = _loss_and_grads(model, (ids, attn, T, adv, mask.float(), None, ref),
                                          position_ids=positions_of(attn))
    model.config._attn_implementation = "flex_attention"
    sh = share_prompts(ids, attn, T, mask, model_config=model.config)
    assert type(sh.attention_mask).__name__ == "BlockMask"
    assert sh.attention_mask.sparsity() > 0  # blocks between siblings are skipped
    loss_sh, grads_sh = _loss_and_grads(
        model, (sh.input_ids, sh.attention_mask, sh.logits_to_keep, adv, None, None,
                sh.pack(ref)), cu_seqlens=sh.cu_seqlens, position_ids=sh.position_ids)
    assert loss_sh == pytest.approx(loss_pad, rel=1e-4, abs=1e-6)
    for n, g in grads_pad.items():
        torch.testing.assert_close(grads_sh[n], g, rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.gpu
def test_torch_varlen_flash_packed_equals_padded_on_gpu():
    """A real flash varlen kernel (PyTorch's bundled FlashAttention) on packed rows, handed
    the boundaries explicitly, in bfloat16: within bfloat16 rounding of the padded sdpa run."""
    from grpo_kernels.hf import torch_varlen
    from grpo_train import batching

    model = tiny_qwen("sdpa", hidden_size=64, intermediate_size=128).cuda().bfloat16()
    ids, attn, mask, T = _long_groups("cuda")
    adv = torch.linspace(-1, 1, ids.shape[0], device="cuda")
    lp_pad = causal_lm_logprobs(model, ids, attn, T, position_ids=positions_of(attn))
    loss_pad, grads_pad = _loss_and_grads(model, (ids, attn, T, adv, mask.float()), beta=0.0,
                                          position_ids=positions_of(attn))
    model.config._attn_implementation = torch_varlen.register()
    batch = dict(input_ids=ids, attention_mask=attn, completion_mask=mask, T=T)
    mb, = batching.micro_batches(batch, "packed", 0, 0, model_config=model.config)
    assert mb.packed.input_ids.shape[0] == 1 and "cu_seq_lens_q" in mb.boundaries
    lp = causal_lm_logprobs(model, *mb.inputs, **mb.model_kwargs)
    torch.testing.assert_close(lp, mb.packed.pack(lp_pad), rtol=0.05, atol=0.05)
    loss, grads = _loss_and_grads(model, (*mb.inputs, adv, None), beta=0.0,
                                  cu_seqlens=mb.cu_seqlens, **mb.model_kwargs)
    assert loss == pytest.approx(loss_pad, rel=0.02, abs=1e-3)
    for n, g in grads_pad.items():
        cos = torch.nn.functional.cosine_similarity(grads[n].float().flatten(),
                                                    g.float().flatten(), dim=0)
        assert cos > 0.99 or g.abs().max() == 0, (n, cos.item())


def test_torch_varlen_refuses_a_padded_batch():
    """The registered varlen implementation reads no mask: a padded batch's mask reaches it
    (transformers' flash mask function is registered with it) and is refused by name, rather
    than dropped (which would attend across the padding). Runs on any device: the refusal
    comes before the kernel."""
    pytest.importorskip("torch.nn.attention.varlen")
    from grpo_kernels.hf import torch_varlen

    model = tiny_qwen("sdpa")
    model.config._attn_implementation = torch_varlen.register()
    ids, attn, mask, T = grouped_batch()
    with pytest.raises(ValueError, match="reads no attention mask"):
        model(input_ids=ids, attention_mask=attn, use_cache=False)
