"""The group's prompt once: shared-prefix rows for Hugging Face causal LMs.

GRPO scores and trains G completions of one prompt. Padded or packed rows run that prompt
through the model G times; a shared-prefix row runs it once. For a group whose prompt has P real
tokens p[0..P-1] and whose completions keep c_i tokens, the row holds

    p[0..P-2] | p[P-1] c_1[0..c_1-1] | p[P-1] c_2[0..c_2-1] | ... | p[P-1] c_G[...]
     prefix     segment 1              segment 2                    segment G

and a 4-D attention mask lets every query see the keys of its own segment up to itself and, for
a segment, the keys of its group's prefix: never a sibling. Positions continue from the prompt
(segment i runs P-1 .. P-1+c_i). Every hidden state of segment i therefore has exactly the keys,
values and positions it has in the padded row of completion i, so its log-probs, the loss and
every gradient equal the padded computation (to the rounding of the attention's sums): the
prefix's keys and values are read by all G segments, and autograd adds the G gradients flowing
back into them, which is the sum the G separate forwards would have given the prompt's weights.

The prompt's last token is repeated at the head of every segment (G - 1 extra positions) because
its hidden state predicts each completion's first token: that way every kept position predicts
the token right after it in the row, as in packed rows, and the loss, the scoring and the
PackedBatch bookkeeping (`logits_to_keep`, `cu_seqlens`, `pack` / `unpack`) are those of
`pack_sequences`. A group is the sequences whose prompt columns (ids and mask) are equal,
wherever they are in the batch; a group of one is a plain packed sequence. Groups are placed in
rows first fit, longest first, at the width `choose_row_width` gives for their lengths; a row's
unused tail is its own segment.

The mask's form follows the attention implementation (`shared_prompt_mask`): sdpa takes a
boolean [R, 1, W, W] (True: attend), eager an additive float one (0 or the dtype's minimum), flex
attention a BlockMask that skips the blocks between siblings. transformers uses a 4-D mask as
given. Flash implementations take no mask and are not shared (`check_shared_prompt` says why),
nor are models with sliding-window or non-attention layers, whose mask a 4-D mask would replace.
Mixture-of-Experts models share unless the caller adds their auxiliary loss over the rows
(`choose_layout(aux_loss=True)`): that loss would count the prompt once instead of G times.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .moe import router_logits_off
from .packed_rows import (
    PackedBatch,
    agreement_atol,
    check_prompt_and_completion,
    logits_disagree,
)
from .row_width import choose_row_width, first_fit
from .unwrap import text_config, text_vocab_size

__all__ = ["check_shared_prompt", "share_prompts", "shared_prompt_mask"]

MASKED_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")  # those that take a 4-D mask


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int
                  ) -> list[list[int]]:
    """The sequences with equal prompt columns (ids and mask of the first L - T columns),
    wherever they are in the batch: [[s, ...], ...] in order of first appearance (a shuffled
    batch still shares every prompt whose completions it holds)."""
    L = input_ids.shape[1]
    mask = attention_mask[:, :L - T]
    prompt = torch.cat([input_ids[:, :L - T] * mask, mask], dim=1)  # pad ids do not matter
    _, which = torch.unique(prompt, dim=0, return_inverse=True)  # [S] group of each
    groups: dict[int, list[int]] = {}
    for s, g in enumerate(which.tolist()):
        groups.setdefault(g, []).append(s)
    return list(groups.values())


def share_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                  completion_mask: torch.Tensor | None = None, *, pad_token_id: int = 0,
                  model_config=None, mask_dtype: torch.dtype = torch.float32) -> PackedBatch:
    """Shared-prefix rows (module docstring) of a padded batch: input_ids, attention_mask
    [S, L]; the completion is the last `logits_to_keep` = T columns; completion_mask [S, T]
    (default: attention_mask's last T columns) keeps a prefix of each row. model_config: the
    model's config, whose attention implementation sets the mask's form and the rows' width;
    mask_dtype: the additive mask's dtype (eager). Returns a PackedBatch whose
    `attention_mask` is the 4-D mask to pass with its input_ids and position_ids."""
    prompt, comp = check_prompt_and_completion(input_ids, attention_mask, logits_to_keep,
                                               completion_mask)
    S, L = input_ids.shape
    T, device = logits_to_keep, input_ids.device
    P = prompt.sum(dim=1).tolist()  # [S] real prompt tokens
    C = comp.sum(dim=1).tolist()  # [S] kept completion tokens
    groups = prompt_groups(input_ids, attention_mask, T)
    lengths = [P[g[0]] - 1 + sum(1 + C[s] for s in g) for g in groups]
    W = choose_row_width(lengths, model_config)
    row, offset, used = first_fit(lengths, W)
    R = len(used)
    # the layout is built on the CPU (no device synchronization per sequence); the token ids
    # are then gathered on the batch's device in one step: src = each position's flat index
    # into input_ids [S·L], -1 for filler
    prompt_cols, comp_cols = prompt.cpu(), comp.cpu()
    src = torch.full((R * W,), -1, dtype=torch.int64)
    pos = torch.zeros(R * W, dtype=torch.int64)
    doc = torch.full((R * W,), -1, dtype=torch.int64)  # segment id per position
    prefix_of = torch.full((R * W,), -1, dtype=torch.int64)  # the prefix a segment sees
    seg_start = [0] * S  # flat position of each sequence's segment
    n_doc = 0
    for g, group in enumerate(groups):
        at, first = row[g] * W + offset[g], group[0]
        prompt_src = first * L + prompt_cols[first].nonzero().squeeze(1)  # [P]
        n = P[first] - 1
        src[at:at + n], pos[at:at + n], doc[at:at + n] = prompt_src[:-1], torch.arange(n), n_doc
        # a one-token prompt has an empty prefix: no segment of its own, nothing to see
        prefix, n_doc, at = (n_doc, n_doc + 1, at + n) if n else (-1, n_doc, at)
        for s in group:
            k = 1 + C[s]
            seg_start[s] = at
            src[at] = prompt_src[-1]
            src[at + 1:at + k] = s * L + (L - T) + comp_cols[s].nonzero().squeeze(1)
            pos[at:at + k] = torch.arange(n, n + k)
            doc[at:at + k], prefix_of[at:at + k] = n_doc, prefix
            n_doc, at = n_doc + 1, at + k
    src = src.to(device)
    ids = torch.where(src >= 0, input_ids.reshape(-1)[src.clamp(min=0)],
                      torch.full_like(src, pad_token_id, dtype=input_ids.dtype))
    for r, u in enumerate(used):  # each row's filler tail: its own segment, positions from 0
        doc[r * W + u:(r + 1) * W] = n_doc + r
        pos[r * W + u:(r + 1) * W] = torch.arange(W - u)
    # kept token j of sequence s sits at seg_start + 1 + j; the position before it predicts it
    keep = torch.cat([torch.arange(seg_start[s], seg_start[s] + C[s]) for s in range(S)]
                     or [torch.zeros(0, dtype=torch.int64)])
    cu = torch.zeros(S + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(C, dtype=torch.int64).cumsum(0)
    doc, prefix_of = doc.view(R, W).to(device), prefix_of.view(R, W).to(device)
    return PackedBatch(
        input_ids=ids.view(R, W), position_ids=pos.view(R, W).to(device),
        logits_to_keep=keep.to(device), cu_seqlens=cu.to(device),
        token_index=comp.reshape(-1).nonzero().squeeze(1), shape=(S, T),
        real_tokens=sum(lengths), row_lengths=tuple(used),
        attention_mask=shared_prompt_mask(doc, prefix_of, model_config, mask_dtype),
        segments=(doc, prefix_of))


def shared_prompt_mask(doc: torch.Tensor, prefix_of: torch.Tensor, model_config=None,
                       dtype: torch.dtype = torch.float32):
    """The 4-D mask of shared-prefix rows for the config's attention implementation. doc
    [R, W]: each position's segment; prefix_of [R, W]: the segment whose keys it may also see
    (-1: none). Query q sees key k of its row iff k <= q and k's segment is q's own or q's
    prefix. sdpa (and no config): bool [R, 1, W, W]; eager: float `dtype` [R, 1, W, W], 0 or
    the dtype's minimum; flex_attention: a BlockMask."""
    impl = getattr(model_config, "_attn_implementation", None) or "sdpa"
    if impl not in MASKED_IMPLEMENTATIONS:
        raise ValueError(f"attention {impl!r} takes no 4-D mask; shared prompts need one of "
                         f"{MASKED_IMPLEMENTATIONS}")
    R, W = doc.shape
    if impl == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def sees(b, h, q, k):  # the rule above, per (row, query, key)
            own = doc[b, k] == doc[b, q]
            return (k <= q) & (own | (doc[b, k] == prefix_of[b, q]))

        return create_block_mask(sees, R, None, W, W, device=doc.device)
    allowed = _allowed_blocks(doc, prefix_of)  # [R, 1, W(q), W(k)]
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=doc.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def _allowed_blocks(doc: torch.Tensor, prefix_of: torch.Tensor) -> torch.Tensor:
    """The rule of `shared_prompt_mask` as bool [R, 1, W, W], written block by block: segments
    are contiguous runs of `doc`, so the allowed keys of a segment's queries are a causal
    triangle on its own run and, with a prefix, the whole prefix run (which lies before it).
    Only those blocks are written into a zeroed mask: a few writes per segment, instead of
    comparing W² segment ids per row (seconds on a CPU at W ~ 5,000)."""
    R, W = doc.shape
    allowed = torch.zeros(R, 1, W, W, dtype=torch.bool, device=doc.device)
    d, p = doc.cpu(), prefix_of.cpu()
    starts = torch.ones(R, W, dtype=torch.bool)
    starts[:, 1:] = d[:, 1:] != d[:, :-1]
    longest = 0
    runs = []  # (row, start, end, prefix segment id)
    for r in range(R):
        bounds = starts[r].nonzero().squeeze(1).tolist() + [W]
        for a, b in zip(bounds[:-1], bounds[1:]):
            runs.append((r, a, b, int(p[r, a])))
            longest = max(longest, b - a)
    tri = torch.ones(longest, longest, dtype=torch.bool, device=doc.device).tril()
    where = {(r, int(d[r, a])): (a, b) for r, a, b, _ in runs}  # a segment's run in its row
    for r, a, b, prefix in runs:
        allowed[r, 0, a:b, a:b] = tri[:b - a, :b - a]
        if prefix >= 0:
            pa, pb = where[(r, prefix)]
            allowed[r, 0, a:b, pa:pb] = True
    return allowed


_SHARING_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _config_refusal(config) -> str | None:
    """Why a config's model cannot take shared-prefix rows, from the config alone; or None."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKED_IMPLEMENTATIONS:
        return (f"attention {impl!r} takes no 4-D mask (shared prompts need one of "
                f"{', '.join(MASKED_IMPLEMENTATIONS)})")
    text = text_config(config)
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return (f"layers of kind {sorted(kinds - {'full_attention'})} (a 4-D mask would replace "
                "their own window or state)")
    if getattr(text, "alibi", False) or getattr(text, "model_type", None) == "bloom":
        return "ALiBi position biases (built from a 2-D mask; a 4-D mask gives them no positions)"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "sliding-window attention (a 4-D mask would replace the window)"
    return None


def check_shared_prompt(model: nn.Module, atol: float | None = None) -> str | None:
    """None if `model` can run shared-prefix rows exactly, else why not (a sentence).

    Refuses from the config first (`_config_refusal`), then runs the model once on a prompt
    with two completions, shared and one sequence at a time, and compares the completions'
    logits. Cached per model, attention implementation (`hf.attention_choice` may check
    another implementation than the model's own) and bound. Pass the model before any DDP/FSDP
    wrapper (a PEFT wrapper is fine). atol: relative to max(1, the largest logit); default
    `packed_rows.agreement_atol(model)`."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    seen = _SHARING_CHECKED.setdefault(model, {})
    key = (impl, agreement_atol(model) if atol is None else atol)  # a dtype's bound, or atol
    if key in seen:
        return seen[key]
    reason = _config_refusal(config) if config is not None else "the model has no config"
    if reason is None:
        reason = _compare_with_separate(model, config, atol)
    seen[key] = reason
    return reason


def _compare_with_separate(model: nn.Module, config, atol: float) -> str | None:
    vocab = text_vocab_size(config)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 9), generator=gen)
    ids[1, :4] = ids[0, :4]  # one 4-token prompt, two 5-token completions
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()  # no dropout in the comparison
    logits_only = router_logits_off(model)  # no MoE aux loss over the 4-D mask
    try:
        with torch.no_grad():
            batch = share_prompts(ids, mask, 5, model_config=config)
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids, use_cache=False,
                        **logits_only).logits.float()
            shared = out.reshape(-1, out.shape[-1])[batch.logits_to_keep]
            alone = model(input_ids=ids, use_cache=False, **logits_only).logits.float()[:, 3:8]
        err = logits_disagree(model, shared, alone.reshape(shared.shape), atol)
        if err is not None:
            return (f"{type(model).__name__} with attention {config._attn_implementation!r} "
                    f"gives other logits on a shared-prefix row ({err:.2g} from separate "
                    "forwards)")
    except Exception as exc:  # noqa: BLE001  (any failure means: do not share)
        return (f"{type(model).__name__} failed on a shared-prefix row: "
                f"{type(exc).__name__}: {exc}")
    finally:
        model.train(was_training)
    return None
