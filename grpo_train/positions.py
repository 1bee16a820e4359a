"""Whether prompt + completion fit the model's positions: `check_positions` runs once at start,
before the format warm-up and before anything is written.

A sequence of a prompt of p tokens and a completion that runs to --max_new_tokens M takes
positions 0 .. p + M - 1 (generation, scoring and the loss count positions over real tokens), so
it fits a model of L positions (its config's max_position_embeddings) when p + M <= L. Models
differ in what happens past L:

- a learned position table (GPT-2's `wpe`, OPT's): position L is an index past the table, and
  the forward fails, on CPU with an IndexError, on CUDA with a device-side assert;
- computed positions (rotary, as Llama and Qwen2 have; ALiBi): the forward runs, but on
  positions the model was never trained on, and its completions degrade silently.

What is certain from the flags and the data is an error (`UsageError` naming the flags and L):
any prompt past L with a learned table, or every prompt past L (the shortest included) with
computed positions. Where only some prompts can pass L with computed positions, one warning line
says how many.
"""

from __future__ import annotations

import torch

from .flags import UsageError

CHUNK = 1024  # prompts tokenized per call: the lengths are kept, not the ids


def position_limit(model) -> tuple[int, str] | None:
    """(L, kind) of `model`: L = its text config's max_position_embeddings, kind "learned" (a
    position table: an nn.Embedding other than the token embedding with L rows, or L + 2 as
    OPT's offset table) or "rotary" / "computed" (no table: positions past L run untrained).
    None when the config names no limit."""
    config = model.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    tokens = model.get_input_embeddings()
    for module in model.modules():
        if (isinstance(module, torch.nn.Embedding) and module is not tokens
                and module.num_embeddings in (limit, limit + 2)):
            return limit, "learned"
    rotary = any("rotary" in type(m).__name__.lower() for m in model.modules())
    return limit, "rotary" if rotary else "computed"


def prompt_lengths(tokenizer, examples: list[dict], cfg, render_prompts) -> list[int]:
    """Each example's prompt length in tokens as generation encodes it (chat template, system
    prompt, --max_prompt_length's truncation). render_prompts: `models.render_prompts` (given
    by its caller, which imports this module)."""
    templated = bool(getattr(tokenizer, "chat_template", None))  # as models.encode_prompts
    lengths = []
    for i in range(0, len(examples), CHUNK):
        texts = render_prompts(tokenizer, examples[i:i + CHUNK], cfg.system_prompt)
        ids = tokenizer(texts, add_special_tokens=not templated)["input_ids"]
        lengths.extend(len(row) for row in ids)
    if cfg.max_prompt_length is not None:
        lengths = [min(n, cfg.max_prompt_length) for n in lengths]
    return lengths


def check_positions(model, tokenizer, cfg, examples: list[dict], say, render_prompts) -> None:
    """Raise a UsageError, or warn with `say`, where a prompt of `examples` (training and
    held-out) plus --max_new_tokens can pass the model's positions (the module docstring);
    render_prompts as `prompt_lengths` takes it."""
    found = position_limit(model)
    if found is None or not examples:
        return
    limit, kind = found
    new = cfg.max_new_tokens
    if cfg.max_prompt_length is not None and cfg.max_prompt_length + new <= limit:
        return  # no prompt is longer: nothing to tokenize
    lengths = prompt_lengths(tokenizer, examples, cfg, render_prompts)
    over = sum(n + new > limit for n in lengths)
    if not over:
        return
    shortest, longest = min(lengths), max(lengths)
    what = {"learned": f"a learned table of {limit} positions: a position past it fails in the "
                       "forward",
            "rotary": "rotary positions, which run past the limit without an error, on "
                      "positions the model was never trained on",
            "computed": "computed positions, which run past the limit without an error, "
                        "untrained"}[kind]
    room = limit - new  # the longest prompt that fits
    fixes = []
    if limit - longest >= 1:
        fixes.append(f"lower --max_new_tokens to {limit - longest} or less")
    if room >= 1:
        fixes.append(f"pass --max_prompt_length {room} (keeps the last {room} prompt tokens)")
    fix = ", or ".join(fixes) or f"lower --max_new_tokens below {limit}"
    counts = (f"{over} of {len(lengths)} prompts (training and held-out, {shortest}-{longest} "
              f"tokens) with --max_new_tokens {new} can reach past the model's {limit} "
              "positions (max_position_embeddings in its config)")
    if kind == "learned" or shortest + new > limit:
        every = "" if kind == "learned" else " (every prompt)"
        raise UsageError(f"{counts}{every}; it has {what}: {fix}")
    say(f"warning: {counts}; it has {what}, so completions that run that long may degrade: "
        f"{fix} to stay within them")
