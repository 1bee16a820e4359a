"""Whether a padded forward that passes no position_ids gives a sequence the positions that packed
and shared rows give it.

Packed rows (`packed_rows.pack_sequences`) and shared rows (`shared_prompt.share_prompts`) hand
the model `position_ids` that count from each sequence's first real token. A padded forward
equals them only if it does the same. grpo_train's padded forward passes cumsum(mask) - 1, so
it does. TRL 1.16's passes no position_ids, and the model numbers the columns itself: a
left-padded prompt with k pads then starts at position k for most models. That changes nothing
for rotary (RoPE) or other relative positions, whose outputs do not change under a uniform
shift. A model with absolute, learned position embeddings (GPT-2) sees other embeddings, and its
log-probs differ from the packed ones. A model that counts positions from the attention mask
when given none (OPT) agrees again.

`check_padded_positions` tests the behaviour itself rather than the model's name: one short
sequence, run once left-padded with its attention mask and no position_ids (the caller's padded
forward) and once alone with position_ids = arange(L) (as packed rows run it), must give the
same logits within `packed_rows.agreement_atol`. A model whose forward takes no position_ids, or
fails on them, is refused: packed and shared rows pass position_ids, so it could not run them.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .packed_rows import agreement_atol, logits_disagree
from .unwrap import text_vocab_size

__all__ = ["PADS", "check_padded_positions"]

# Left pads in the check's padded row: without position_ids, a model that numbers the columns
# itself shifts the sequence's positions by this many.
PADS = 3
_LENGTH = 6  # the check's sequence

_POSITIONS_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_padded_positions(model: nn.Module, atol: float | None = None) -> str | None:
    """None if `model`, run on a left-padded batch with its attention mask and no position_ids,
    gives each sequence the logits it has with position_ids counting from its first token (as
    in packed and shared rows); else why not (a sentence).

    Runs the model twice on one short sequence (module docstring); cached per model, attention
    implementation and bound, as the other layout checks are. Pass the model before a DDP/FSDP
    wrapper (a PEFT wrapper is fine). atol: relative to max(1, the largest logit); default
    `agreement_atol(model)`."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    seen = _POSITIONS_CHECKED.setdefault(model, {})
    key = (impl, agreement_atol(model) if atol is None else atol)  # a dtype's bound, or atol
    if key not in seen:
        seen[key] = _compare_padded(model, config, atol)
    return seen[key]


def _compare_padded(model: nn.Module, config, atol: float | None) -> str | None:
    name = type(model).__name__
    vocab = text_vocab_size(config)
    pad = getattr(config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, _LENGTH), generator=gen).to(device)  # [1, L]
    padded_ids = torch.cat([ids.new_full((1, PADS), pad), ids], dim=1)  # [1, PADS + L]
    mask = torch.cat([torch.zeros_like(ids[:, :PADS]), torch.ones_like(ids)], dim=1)
    positions = torch.arange(_LENGTH, device=device).unsqueeze(0)  # [1, L], packed rows' own
    was_training = model.training
    model.eval()  # no dropout in the comparison
    try:
        with torch.no_grad():
            padded = model(input_ids=padded_ids, attention_mask=mask,
                           use_cache=False).logits.float()[:, PADS:]
            rows = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
        err = logits_disagree(model, padded, rows, atol)
        if err is not None:
            return (f"{name} reads other positions in a left-padded forward without "
                    f"position_ids than in packed rows (logits differ by {err:.2g} with "
                    f"{PADS} left pads), as absolute position embeddings do")
    except Exception as exc:  # noqa: BLE001  (any failure means: do not pack)
        return (f"{name} failed on a padded sequence or on position_ids: "
                f"{type(exc).__name__}: {exc}")
    finally:
        model.train(was_training)
    return None
