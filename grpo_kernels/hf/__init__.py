"""Hugging Face integration: GRPO loss and log-probs of any `AutoModelForCausalLM` from hidden
states (`causal_lm.py`), its output head (`output_head.py`) and the once-per-model check of it
(`head_check.py`), PEFT adapters on the output head (`head_adapters.py`), packed (padding-free)
rows (`packed_rows.py`, their width in `row_width.py`), rows holding a group's prompt once
(`shared_prompt.py`), the choice between those and padded batches (the `RowLayout` of
`row_layout.py`, chosen in `row_plan.py`; `padded_positions.py` where the padded forward passes
no position_ids), the attention implementation their forwards run (`attention_choice.py`),
FSDP2-sharded models (`fsdp.py`), the Mixture-of-Experts auxiliary loss (`moe.py`) and heads
sharded by DeepSpeed ZeRO-3 (`zero3.py`, used by `resolved_head`)."""

from . import causal_lm
from .attention_choice import (
    ATTENTION_RULES,
    AttentionChoice,
    AttentionRule,
    choose_attention,
    using_attention,
)
from .causal_lm import *  # noqa: F403  (the names of causal_lm.__all__)
from .fsdp import fsdp2_root, run_as_forward
from .head_adapters import add_lora, has_tuner_adapter
from .moe import load_balancing_loss, router_logits_off
from .packed_rows import PackedBatch, check_packed_attention, pack_sequences
from .padded_positions import check_padded_positions
from .row_layout import ROW_LAYOUTS, RowLayout, parse_row_layout
from .row_plan import LayoutChoice, choose_layout, plan_rows, row_inputs
from .row_width import RowWidthRule, choose_row_width, row_width_rule
from .shared_prompt import check_shared_prompt, share_prompts, shared_prompt_mask
from .unwrap import prompt_learning_adapter

__all__ = [*causal_lm.__all__, "ATTENTION_RULES", "AttentionChoice", "AttentionRule",
           "ROW_LAYOUTS", "LayoutChoice", "RowLayout", "RowWidthRule",
           "add_lora", "choose_layout", "fsdp2_root", "has_tuner_adapter", "PackedBatch",
           "parse_row_layout", "plan_rows", "prompt_learning_adapter", "row_inputs",
           "row_width_rule",
           "check_packed_attention", "check_padded_positions", "check_shared_prompt",
           "choose_attention", "choose_row_width",
           "load_balancing_loss", "pack_sequences", "router_logits_off", "run_as_forward",
           "share_prompts",
           "shared_prompt_mask", "using_attention"]
