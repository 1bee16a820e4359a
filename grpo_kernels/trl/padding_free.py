"""Padding-free forwards for the TRL subclass: TRL's padded batches run through the model body as
packed rows, or as shared-prefix rows that hold each group's prompt once (`grpo_kernels.hf`'s
row plan: `choose_layout`, `plan_rows`, `row_inputs`, the same as grpo_train's).

TRL 1.16 scores and trains on padded batches [S, L]: prompts left-padded to the longest prompt,
completions right-padded to the longest completion, and every padded position runs through the
whole body. Here the same batch is laid out as rows [R, W] that hold only the real tokens (the
prompt and the completion up to its mask's last 1), position_ids restarting per sequence and no
attention mask; transformers reads the sequence boundaries from the restarts. The hidden states
of the kept completion positions stay packed: the fused head runs on the N kept tokens only (with
`cu_seqlens`), and its per-token terms go back to TRL's [S, T] grid for TRL's metrics, so TRL's
normalization, metrics and accumulation see the batch TRL built.

- Scoring (old / reference policy, `packed_scores`) groups rows into forwards by positions, not
  sequences: each forward takes at most batch_size · L positions, the footprint of one of TRL's
  padded scoring chunks, so fewer forwards run and none holds more than TRL's did. Shared rows
  are cut between prompt groups, so a forward holds whole groups of the generation batch (TRL
  puts a prompt's G completions next to each other there).
- The loss (`packed_completion_hidden`, then `losses.packed_grpo_loss`) runs one forward per TRL
  micro-batch, as TRL does; the micro-batch is TRL's, so its loss normalization and
  gradient-accumulation scaling are TRL's. Shared rows share every prompt whose completions
  meet in the micro-batch, wherever TRL's shuffle put them; the micro-batches stay TRL's.

Exact where the model's attention reads packed position_ids (`check_packed_attention`), where
TRL's padded forward, which passes no position_ids, gives each sequence the positions packed rows
give it (`check_padded_positions`; absolute position embeddings such as GPT-2's do not) and, for
shared rows, where the model takes a 4-D mask (`check_shared_prompt`); all are checked once per
model at the trainer's construction (`model_support.ModelSupport`), and one log line says which
layout runs and why. A batch whose completion mask is not a prefix of each row (1s then 0s)
cannot be packed without changing what the kept tokens attend to: it runs padded.
"""

from __future__ import annotations

import torch

from ..hf import (
    RowLayout,
    completion_hidden_states,
    completion_logprobs,
    fsdp2_root,
    pack_sequences,
    plan_rows,
    row_inputs,
    unwrap_model,
)
from ..hf.packed_rows import boundaries_of
from ..hf.row_width import takes_boundaries
from ..hf.shared_prompt import prompt_groups

__all__ = ["equal_count_across", "packable", "packed_completion_hidden",
           "packed_scores"]


def packable(attention_mask: torch.Tensor, completion_mask: torch.Tensor) -> bool:
    """Whether a padded batch packs exactly: attention_mask [S, L] whose last T columns are
    completion_mask [S, T] (TRL's layout), every completion mask a prefix (1s then 0s, as an
    EOS mask is) and every sequence with at least one prompt token."""
    T = completion_mask.shape[1]
    comp = completion_mask.bool()
    prompt = attention_mask[:, :attention_mask.shape[1] - T].bool()
    return (attention_mask.shape[1] > T and bool(prompt.any(dim=1).all())
            and torch.equal(comp, comp.int().cummin(dim=1).values.bool()))


def _config(model):
    """The config whose attention implementation sets the rows' width (None: narrow rows)."""
    return getattr(unwrap_model(model), "config", None)


def packed_completion_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             completion_mask: torch.Tensor, aux_loss=None,
                             layout=RowLayout.PACKED):
    """(hidden, packed, aux): the body's hidden states [N, D] of the positions that predict the
    N kept completion tokens (completion_mask's 1s, in sequence order), from one forward of the
    batch's `layout` rows (RowLayout.PACKED or SHARED) `packed` (a PackedBatch). aux: None, or with
    `aux_loss` (fn(router_logits, attention_mask), e.g. `grpo_kernels.hf.load_balancing_loss(
    model)`) the MoE auxiliary loss over the rows' real tokens, which are the padded batch's
    unmasked ones: the same statistics (packed rows only: `choose_layout` refuses shared
    rows where the aux loss is added, as they would count each prompt once).
    input_ids, attention_mask [S, L]; completion_mask [S, T] (the last T columns)."""
    T = completion_mask.shape[1]
    config = _config(model)
    packed = plan_rows(input_ids, attention_mask, T, completion_mask, layout, config)
    out = completion_hidden_states(model, packed.input_ids, packed.attention_mask,
                                   packed.logits_to_keep,
                                   return_router_logits=aux_loss is not None,
                                   **row_inputs(packed, config))
    hidden, aux = (out[0], aux_loss(out[1], packed.real_mask())) if aux_loss else (out, None)
    return hidden[0], packed, aux


def _row_chunks(R: int, W: int, budget: int, equal_count_across=None) -> list[range]:
    """Consecutive row ranges of at most max(1, budget // W) rows each. equal_count_across: a
    function mapping this process's chunk count to the largest count over all processes (for
    sharded models, whose every forward is a collective); missing chunks are empty ranges."""
    per = max(1, budget // W)
    chunks = [range(r, min(r + per, R)) for r in range(0, R, per)]
    if equal_count_across is not None:
        chunks += [range(R, R)] * (equal_count_across(len(chunks)) - len(chunks))
    return chunks


def packed_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  logits_to_keep: int, *, batch_size: int | None, return_entropy: bool,
                  equal_count_across=None, layout=RowLayout.PACKED, **logprob_kwargs):
    """Log-probs (and entropies) [S, T] float32 of the last logits_to_keep = T tokens, zero at
    masked completion positions, from `layout` rows (RowLayout.PACKED or SHARED) in forwards of at
    most batch_size · L positions (batch_size None: one forward). TRL's
    `_get_per_token_logps_and_entropies` on the padded batch gives the same values.
    logprob_kwargs: `completion_logprobs`' (temperature, head_dtype). equal_count_across: see
    `_row_chunks` (a chunk with nothing to score runs `_idle_forward`)."""
    if layout == RowLayout.SHARED:
        return _shared_scores(model, input_ids, attention_mask, logits_to_keep, batch_size,
                              return_entropy, equal_count_across, **logprob_kwargs)
    S, L = input_ids.shape
    T = logits_to_keep
    config = _config(model)
    packed = pack_sequences(input_ids, attention_mask, T, model_config=config)
    flash = takes_boundaries(config)
    rows, positions = packed.input_ids, packed.logits_to_keep  # [R, W], [N]
    R, W = rows.shape
    row_of = positions // W
    logp = torch.zeros(positions.numel(), dtype=torch.float32, device=input_ids.device)
    ent = torch.zeros_like(logp) if return_entropy else None
    budget = (S if batch_size is None else batch_size) * L
    for chunk in _row_chunks(R, W, budget, equal_count_across):
        sel = ((row_of >= chunk.start) & (row_of < chunk.stop)).nonzero().squeeze(1)
        if sel.numel() == 0:  # no chunk here, or rows whose completions are fully masked
            if equal_count_across is not None:  # a sharded forward is a collective: run one
                _idle_forward(model, rows, **logprob_kwargs)
            continue
        pos = packed.position_ids[chunk.start:chunk.stop]
        out = completion_logprobs(
            model, rows[chunk.start:chunk.stop], None, positions[sel] - chunk.start * W,
            position_ids=pos, return_entropy=return_entropy,
            **(boundaries_of(pos) if flash else {}), **logprob_kwargs)
        lp, en = out if return_entropy else (out, None)
        logp = logp.index_copy(0, sel, lp.to(logp.device, torch.float32))
        if return_entropy:
            ent = ent.index_copy(0, sel, en.to(ent.device, torch.float32))
    return packed.unpack(logp), None if ent is None else packed.unpack(ent)


def _idle_forward(model, input_ids: torch.Tensor, **logprob_kwargs) -> None:
    """A two-token forward whose result is dropped: keeps a sharded model's collectives in step
    with processes that have a chunk to score where this one has none."""
    completion_logprobs(model, input_ids[:1, :2], None, torch.zeros(1, dtype=torch.long),
                        position_ids=torch.arange(2, device=input_ids.device)[None],
                        **logprob_kwargs)


def _group_chunks(groups: list[list[int]], cost: list[int], budget: int,
                  equal_count_across=None) -> list[list[int]]:
    """Sequence index lists, whole prompt groups each, of at most `budget` shared positions
    (a group larger than the budget goes alone); padded with empty lists to the count over
    processes (see `_row_chunks`)."""
    chunks, current, used = [], [], 0
    for group, c in zip(groups, cost):
        if current and used + c > budget:
            chunks.append(current)
            current, used = [], 0
        current, used = current + group, used + c
    chunks.append(current)
    if equal_count_across is not None:
        chunks += [[]] * (equal_count_across(len(chunks)) - len(chunks))
    return chunks


def _shared_scores(model, input_ids, attention_mask, T, batch_size, return_entropy,
                   equal_count_across, **logprob_kwargs):
    """`packed_scores` on shared-prefix rows: forwards of whole prompt groups."""
    S, L = input_ids.shape
    config = _config(model)
    comp = attention_mask[:, -T:]
    groups = prompt_groups(input_ids, attention_mask, T)
    prompt_tokens = attention_mask[:, :L - T].sum(dim=1).tolist()
    kept = comp.sum(dim=1).tolist()
    cost = [prompt_tokens[g[0]] - 1 + sum(1 + kept[s] for s in g) for g in groups]
    budget = (S if batch_size is None else batch_size) * L
    logp = torch.zeros(S, T, dtype=torch.float32, device=input_ids.device)
    ent = torch.zeros_like(logp) if return_entropy else None
    for seqs in _group_chunks(groups, cost, budget, equal_count_across):
        rows = None
        if seqs:
            idx = torch.tensor(seqs, device=input_ids.device)
            rows = plan_rows(input_ids[idx], attention_mask[idx], T, None, RowLayout.SHARED,
                             config)
        if rows is None or rows.logits_to_keep.numel() == 0:  # no chunk here, or no kept token
            if equal_count_across is not None:  # a sharded forward is a collective: run one
                _idle_forward(model, input_ids, **logprob_kwargs)
            continue
        out = completion_logprobs(model, rows.input_ids, rows.attention_mask,
                                  rows.logits_to_keep, return_entropy=return_entropy,
                                  **row_inputs(rows, config), **logprob_kwargs)
        lp, en = out if return_entropy else (out, None)
        logp[idx] = rows.unpack(lp.to(logp.device, torch.float32))
        if return_entropy:
            ent[idx] = rows.unpack(en.to(ent.device, torch.float32))
    return logp, ent


def equal_count_across(accelerator, model):
    """For packed scoring of a sharded model (FSDP2, DeepSpeed ZeRO-3), whose every forward is a
    collective: a function giving the largest chunk count over the processes; None otherwise."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    sharded = fsdp2_root(model) is not None or is_deepspeed_zero3_enabled()
    if accelerator.num_processes == 1 or not sharded:
        return None
    device = accelerator.device
    return lambda n: int(accelerator.gather(torch.tensor([n], device=device)).max())
