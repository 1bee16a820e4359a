"""Generation: G sampled completions per prompt (and one greedy completion per prompt for the
held-out evaluation), with EOS handling and the completion mask.

`generate` returns the batch the rest of a step works on (see its docstring for the keys):
prompt + completion token ids [B, Lp + T] with prompts left-padded and completions right-padded,
and the [B, T] completion mask (1 up to and including the first EOS).
"""

from __future__ import annotations

import torch

from . import sharding
from .models import completion_mask, encode_prompts, render_prompts
from .rewards import accuracy


@torch.no_grad()
def generate(model, examples: list[dict], ctx: dict, greedy: bool = False) -> dict:
    """G sampled completions per prompt (1 greedy one with greedy=True), with EOS handling."""
    cfg, tok = ctx["cfg"], ctx["tokenizer"]
    G = 1 if greedy else cfg.num_generations
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(
        tok, render_prompts(tok, examples, cfg.system_prompt), cfg.max_prompt_length, device)
    prompt_ids = prompt_ids.repeat_interleave(G, dim=0)  # [B, Lp], groups contiguous
    prompt_mask = prompt_mask.repeat_interleave(G, dim=0)
    sampling = dict(do_sample=False) if greedy else dict(
        do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    was_training = model.training
    model.eval()
    with sharding.full_parameters(model), ctx["autocast"]:  # FSDP: gathered once per call
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
                             eos_token_id=ctx["eos_ids"], pad_token_id=tok.pad_token_id,
                             use_cache=True, **sampling)
    model.train(was_training)
    completion_ids = out[:, prompt_ids.shape[1]:]  # [B, T]
    if completion_ids.shape[1] == 0:  # nothing generated at all: keep one masked column
        completion_ids = torch.full((out.shape[0], 1), tok.pad_token_id, device=device)
    comp_mask = completion_mask(completion_ids, ctx["eos_ids"])  # [B, T]
    lengths = comp_mask.sum(dim=1)
    is_eos = torch.isin(completion_ids, torch.tensor(ctx["eos_ids"], device=device))
    truncated = ~is_eos.any(dim=1)
    if cfg.mask_truncated_completions:
        comp_mask = comp_mask * (~truncated).unsqueeze(1).long()
    texts = tok.batch_decode([c[:n] for c, n in zip(completion_ids.tolist(), lengths.tolist())],
                             skip_special_tokens=True)
    columns = {k: [ex.get(k) for ex in examples for _ in range(G)]
               for k in examples[0] if k != "prompt"}
    columns["completion_ids"] = [c[:n] for c, n in zip(completion_ids.tolist(), lengths.tolist())]
    return dict(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),  # [B, Lp + T]
        attention_mask=torch.cat([prompt_mask, comp_mask], dim=1),
        completion_mask=comp_mask, T=completion_ids.shape[1], texts=texts,
        prompts=[ex["prompt"] for ex in examples for _ in range(G)], columns=columns,
        lengths=lengths, truncated=truncated, prompt_tokens=prompt_mask.sum(),
    )


@torch.no_grad()
def evaluate(model, examples: list[dict], ctx: dict) -> float:
    """Held-out accuracy: one greedy completion per prompt, scored by the built-in accuracy;
    the prompts are split over the processes and the counts summed."""
    accel, cfg = ctx["accel"], ctx["cfg"]
    mine = examples[accel.process_index::accel.num_processes]
    correct, total = 0.0, 0.0
    with sharding.full_parameters(model):  # FSDP: one gather, whatever each process' count
        for i in range(0, len(mine), cfg.eval_batch_size):
            chunk = mine[i:i + cfg.eval_batch_size]
            batch = generate(model, chunk, ctx, greedy=True)
            scores = accuracy(None, batch["texts"], answer=[ex["answer"] for ex in chunk])
            correct += sum(s for s in scores if s is not None)
            total += sum(s is not None for s in scores)
    counts = accel.reduce(torch.tensor([correct, total], device=accel.device), "sum")
    return (counts[0] / counts[1].clamp(min=1)).item()
