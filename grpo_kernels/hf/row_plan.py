"""One row plan for both trainers: which layout a model's forwards take, and the rows of a batch.

A padded GRPO batch [S, L] (prompts left-padded, completions right-padded) reaches the model body
in one of three row layouts (`RowLayout`):

    padded   as it is: S rows of L positions, with its attention mask
    packed   the real tokens end to end in rows [R, W], position_ids restarting per sequence,
             no mask (`packed_rows.pack_sequences`); flash implementations are also handed the
             boundaries (cu_seq_lens_q/k, max_length_q/k)
    shared   packed, with each group's prompt once and its completions after it, under a 4-D
             mask that keeps siblings apart (`shared_prompt.share_prompts`)

All three give the same log-probs, loss and gradients; where the padded forward passes no
position_ids (TRL's), only for models that `padded_positions.check_padded_positions` allows
(absolute position embeddings see other positions there). `choose_layout` decides once per
model, with the reason as one phrase for the caller's one log line; `plan_rows` lays out a batch and
`row_inputs` gives the model keywords that go with the rows. grpo_train (its micro-batches) and
the TRL subclass (its scoring and loss forwards) both go through these three functions. A row
layout named by a string (a command-line flag, a results row) becomes a `RowLayout`
(`row_layout.py`) through `parse_row_layout`, the one place that reads the names; everything
else compares members.

Not to be confused with the token layouts of `grpo_kernels/token_layouts.py` (where a loss's
per-token values sit: padded [B, T] or packed [N]) or with the width rule of packed rows
(`row_width.RowWidthRule`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packed_rows import PackedBatch, check_packed_attention, pack_sequences
from .padded_positions import check_padded_positions
from .row_layout import RowLayout, parse_row_layout
from .row_width import takes_boundaries
from .shared_prompt import check_shared_prompt, share_prompts
from .unwrap import prompt_learning_adapter, unwrap_model

__all__ = ["LayoutChoice", "choose_layout", "plan_rows", "row_inputs"]


@dataclass(frozen=True)
class LayoutChoice:
    """layout: the row layout chosen; reason: why this one, a phrase for a log line."""

    layout: RowLayout
    reason: str


_AUX_LOSS_REFUSAL = ("the Mixture-of-Experts auxiliary loss would count each prompt once "
                     "instead of once per completion")


def choose_layout(model, *, padding_free: bool = True, share_prompt: bool = True,
                  padded_position_ids: bool = True, aux_loss: bool = False) -> LayoutChoice:
    """The richest layout the caller asks for that `model` computes exactly: shared if
    share_prompt and `check_shared_prompt` allows it, else packed if padding_free and
    `check_packed_attention` allows it, else padded (its reason names both refusals). Shared
    rows do not need packed ones: a model whose own mask handling mixes packed sequences (OPT,
    BioGPT, XGLM) can still take the shared rows' explicit 4-D mask, which
    `check_shared_prompt` compares with separate forwards. padded_position_ids: whether the
    caller's padded forward passes position_ids counting from each sequence's first token
    (grpo_train's passes cumsum(mask) - 1); where it passes none (TRL's), packed and shared rows
    also need `check_padded_positions`, which refuses absolute position embeddings (GPT-2).
    aux_loss: whether the caller adds a Mixture-of-Experts auxiliary loss over the rows' tokens
    (TRL's aux_loss_enabled), which shared rows would change (each prompt counted once, not once
    per completion); routing itself is per token, so MoE models share prompts otherwise. Checks
    run once per model (cached); pass the model before a DDP/FSDP wrapper (a PEFT wrapper is
    fine; a prompt-learning PEFT adapter takes padded rows, `prompt_learning_adapter`)."""
    if not padding_free:
        return LayoutChoice(RowLayout.PADDED, "padding-free rows turned off")
    if (adapter := prompt_learning_adapter(model)) is not None:
        return LayoutChoice(RowLayout.PADDED, f"the PEFT adapter {adapter} puts virtual tokens "
                            "before each row, which in packed or shared rows only the first "
                            "sequence would follow")
    inner = unwrap_model(model)
    positions = None if padded_position_ids else check_padded_positions(inner)
    packed = check_packed_attention(inner) or positions
    shared = None
    if share_prompt:
        shared = positions or (_AUX_LOSS_REFUSAL if aux_loss else check_shared_prompt(inner))
        if shared is None:
            why = "each group's prompt once"
            return LayoutChoice(RowLayout.SHARED,
                                why if packed is None else f"{why} (packed rows refused: {packed})")
    if packed is not None:
        # both refused: the line says why neither runs (once where the reason is the same)
        unshared = "" if shared in (None, packed) else f"; the prompt not shared: {shared}"
        return LayoutChoice(RowLayout.PADDED, f"not packed: {packed}{unshared}")
    if not share_prompt:
        return LayoutChoice(RowLayout.PACKED, "shared prompts turned off")
    return LayoutChoice(RowLayout.PACKED, f"the prompt not shared: {shared}")


def plan_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
              completion_mask: torch.Tensor | None, layout: RowLayout | str,
              model_config=None) -> PackedBatch:
    """The packed or shared rows of a padded batch (input_ids, attention_mask [S, L]; the last
    logits_to_keep = T columns are the completion, completion_mask [S, T] a prefix of each
    row). layout: RowLayout.PACKED or SHARED (or its name). model_config: the model's config
    (its attention sets widths, mask and boundaries)."""
    layout = parse_row_layout(layout)
    if layout is RowLayout.SHARED:
        return share_prompts(input_ids, attention_mask, logits_to_keep, completion_mask,
                             model_config=model_config)
    if layout is RowLayout.PACKED:
        return pack_sequences(input_ids, attention_mask, logits_to_keep, completion_mask,
                              model_config=model_config)
    raise ValueError(f"plan_rows lays out 'packed' or 'shared' rows, got layout "
                     f"{layout.value!r}")


def row_inputs(rows: PackedBatch, model_config=None) -> dict:
    """The model keywords that go with `rows` besides input_ids and attention_mask
    (`rows.attention_mask`, None for packed rows): position_ids, and for packed rows under a
    flash implementation the boundaries (`PackedBatch.boundaries`)."""
    kwargs = dict(position_ids=rows.position_ids)
    if takes_boundaries(model_config) and rows.layout is RowLayout.PACKED:
        kwargs.update(rows.boundaries())
    return kwargs
