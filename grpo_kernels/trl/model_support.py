"""What the TRL subclass must know about the model it trains, in one place: each model-family
quirk with how it is detected and what is checked, and the row layout that follows from them.

    quirk                     detected by                       checked / consequence
    MoE auxiliary loss        TRL's aux_loss_enabled            the modeling module's Mixtral-style
                                                                load-balancing loss is known
                                                                (`hf.load_balancing_loss`), else
                                                                TRL's own implementation runs
    logit transform           the config (`hf.logit_transform`: one short forward
      (Gemma 2's soft cap,      final_logit_softcapping,        (`hf.check_output_head`): the
      Cohere's, Granite's       logit_scale, logits_scaling)    head under that transform gives
      scale)                                                    the model's logits, else TRL's
    output head               get_output_embeddings             the same forward: the body's
                                                                output is the head's input
    DeepSpeed ZeRO-3          the head is a ZeRO-3 partition    the config checks now (head
                              (`hf.zero3.zero3_head`)           gathered); the forward check and
                                                                the layout on the first batch,
                                                                inside DeepSpeed's engine
    FSDP1                     FSDP on, no `fully_shard` root    TRL's own (the fused backward
                                                                needs the full head weight)
    attention over packed     the attention implementation,     the layout (`hf.choose_layout`):
      or shared-prefix rows     layer types, MoE                shared, packed or padded, said
                                                                on one log line with the reason
    positions in TRL's        a left-padded forward without     padded rows where they differ
      padded forward            position_ids against packed     from packed rows' (absolute
                                rows' (`hf.check_padded_        position embeddings: GPT-2)
                                positions`)
    attention implementation  the device, the layout, the       `hf.choose_attention`'s rule
                              model class and config            among sdpa and eager (set for
                                                                the whole model: TRL generates
                                                                with it too), checked to give
                                                                the model's own logits; its own
                                                                log line
    vision inputs             the batch's image keys            that batch runs padded rows
                              (`model_inputs.MULTIMODAL_KEYS`)  (`ModelSupport.packs`)
    PEFT prompt learning      the active adapter's config       padded rows: the PEFT model's
      (prompt, prefix, ...)     (`hf.prompt_learning_adapter`)  forward puts virtual tokens
                                                                before every row, which must
                                                                hold one sequence

`ModelSupport` holds the outcome: `fallback` (why TRL's own implementation must run, or None),
`aux_loss` (the bound MoE loss), `layout`, `attention` (the `hf.AttentionChoice` set on the
model's config, or None where the model keeps its own). The trainer is composed of one and
reads nothing else about the model's family.
"""

from __future__ import annotations

import logging

import torch

from ..hf import (
    AttentionChoice,
    RowLayout,
    check_output_head,
    choose_attention,
    choose_layout,
    fsdp2_root,
    load_balancing_loss,
    resolved_head,
)
from ..hf.unwrap import unwrap_model
from ..hf.zero3 import zero3_head
from .padding_free import packable

logger = logging.getLogger("grpo_kernels.trl.trainer")  # the trainer's one log line


class ModelSupport:
    """The model checks of the table above for one trainer's model.

    model: the trainer's model (before DeepSpeed's engine or an FSDP wrapper, as TRL's __init__
    leaves it); aux_loss_enabled: TRL's; padding_free / share_prompt: the layouts asked for."""

    def __init__(self, model, *, aux_loss_enabled: bool, padding_free: bool,
                 share_prompt: bool):
        self.padding_free, self.share_prompt = padding_free, share_prompt
        self.aux_loss = None  # fn(router_logits, attention_mask): the MoE load-balancing loss
        self.forward_check_pending = False  # ZeRO-3: the head's forward check waits for a batch
        self.attention: AttentionChoice | None = None  # set by `_decide_layout`
        self.fallback = self._moe(model, aux_loss_enabled) or self._head(model)
        self.layout = self._decide_layout(model)

    def _moe(self, model, aux_loss_enabled: bool) -> str | None:
        """Binds the model's auxiliary loss when TRL asks for one; else why it cannot."""
        if not aux_loss_enabled:
            return None
        try:
            self.aux_loss = load_balancing_loss(model)
        except NotImplementedError as exc:
            return f"the MoE auxiliary loss of this model is not known ({exc})"
        return None

    def _head(self, model) -> str | None:
        """Why the head's fused call cannot stand in for the model's logits (None if it can)."""
        try:
            if zero3_head(model):
                # loaded under deepspeed.zero.Init: no forward can run before DeepSpeed's engine
                # wraps the model; the config checks run now (the head gathered for them), the
                # short forward on the first batch (`at_batch`)
                with torch.no_grad():
                    resolved_head(model)
                self.forward_check_pending = True
                return None
            check_output_head(model)  # one short forward: the head takes the body's output
        except (ValueError, NotImplementedError) as exc:
            return str(exc)
        return None

    def _decide_layout(self, model) -> RowLayout:
        """The layout of scoring and loss forwards, said in one log line with the reason."""
        padding_free, share_prompt = self.padding_free, self.share_prompt
        if self.forward_check_pending:
            layout = RowLayout.PADDED
            reason = "not decided before the first batch (DeepSpeed ZeRO-3)"
        elif self.fallback is not None:
            layout = RowLayout.PADDED
            reason = f"the model runs TRL's own implementation ({self.fallback})"
        else:
            # TRL's padded forward passes no position_ids: packed rows must give the same
            # positions (absolute position embeddings, e.g. GPT-2's, do not)
            choice = choose_layout(model, padding_free=padding_free,
                                   share_prompt=padding_free and share_prompt,
                                   padded_position_ids=False,
                                   aux_loss=self.aux_loss is not None)
            layout, reason = choice.layout, choice.reason
        quiet = layout is not RowLayout.PADDED or not padding_free
        (logger.info if quiet else logger.warning)(
            "grpo_kernels.trl.GRPOTrainer: scoring and loss forwards run %s rows: %s "
            "(padding_free=%s, share_prompt=%s)", layout, reason, padding_free, share_prompt)
        self.attention = self._decide_attention(model, layout)
        return layout

    def _decide_attention(self, model, layout: RowLayout) -> AttentionChoice | None:
        """The rule's attention for this device and layout (`hf.choose_attention`), among the
        implementations fit for every forward (scoped=False: TRL's generation runs the same
        model), set on the model's config; None (the model's own implementation) while TRL's
        implementation runs or the decision waits for the first batch (ZeRO-3)."""
        if self.fallback is not None or self.forward_check_pending:
            return None
        choice = choose_attention(model, layout, scoped=False)  # logs its own line, once
        config = unwrap_model(model).config
        if config._attn_implementation != choice.implementation:
            config._attn_implementation = choice.implementation
        return choice

    def at_batch(self, model, fsdp_enabled: bool) -> str | None:
        """Before a forward on `model` (as TRL hands it, possibly wrapped): runs the checks
        deferred to the first batch, then says why TRL's own implementation must run (None if
        the hidden-state path runs)."""
        if self.forward_check_pending and model is not None:
            self.forward_check_pending = False
            try:
                check_output_head(model)
            except (ValueError, NotImplementedError) as exc:
                self.fallback = str(exc)
            self.layout = self._decide_layout(model)
        if self.fallback is not None:
            return self.fallback
        if fsdp_enabled and fsdp2_root(model) is None:
            return ("FSDP1 (FullyShardedDataParallel) shards the lm_head weight; use FSDP2 "
                    "(fsdp_version: 2), whose unshard the fused path uses")
        return None

    def packs(self, attention_mask, completion_mask, multimodal: dict) -> bool:
        """Whether this batch runs as packed or shared rows: a text batch (no image inputs)
        whose masks pack exactly."""
        return (self.layout is not RowLayout.PADDED and not multimodal
                and packable(attention_mask, completion_mask))
