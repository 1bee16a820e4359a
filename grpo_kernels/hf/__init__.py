"""Hugging Face integration: GRPO loss and log-probs of any `AutoModelForCausalLM` from hidden
states (`causal_lm.py`), PEFT adapters on the output head (`head_adapters.py`), packed
(padding-free) rows (`packed_rows.py`), rows holding a group's prompt once (`shared_prompt.py`),
the choice between those and padded batches (`row_plan.py`),
FSDP2-sharded models (`fsdp.py`), the Mixture-of-Experts auxiliary loss (`moe.py`) and heads
sharded by DeepSpeed ZeRO-3 (`zero3.py`, used by `resolved_head`)."""

from . import causal_lm
from .causal_lm import *  # noqa: F403  (the names of causal_lm.__all__)
from .fsdp import fsdp2_root, run_as_forward
from .head_adapters import add_lora, has_tuner_adapter
from .moe import load_balancing_loss
from .packed_rows import PackedBatch, check_packed_attention, choose_row_width, pack_sequences
from .row_plan import LAYOUTS, LayoutChoice, choose_layout, plan_rows, row_inputs
from .shared_prompt import check_shared_prompt, share_prompts, shared_prompt_mask

__all__ = [*causal_lm.__all__, "LAYOUTS", "LayoutChoice", "add_lora", "choose_layout",
           "fsdp2_root", "has_tuner_adapter", "PackedBatch", "plan_rows", "row_inputs",
           "check_packed_attention", "check_shared_prompt", "choose_row_width",
           "load_balancing_loss", "pack_sequences", "run_as_forward", "share_prompts",
           "shared_prompt_mask"]
