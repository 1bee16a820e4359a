"""The group's prompt once: scoring + loss of one GRPO micro-batch, padded, packed and shared.

A random-weight model of the Qwen2.5-0.5B shape (`--layers` decoder layers) gets `--groups`
prompts of `--prompt_tokens` synthetic tokens, each with G completions whose lengths the
long-tailed profile draws (`benchmarks.lengths`, cap `--cap`; never zeros, never stopped
early). Each layout (grpo_train's micro-batches, `grpo_train.batching.micro_batches`: the
route the trainer takes) then runs what a step runs on it:

    scoring   no-grad log-probs of the completion tokens (the reference policy's, as beta > 0
              needs; old log-probs cost the same)
    loss      the fused GRPO loss's forward + backward (beta 0.04), gradients into every weight

Each row gives the positions the body computes per forward (a count no hardware changes: padded
rows x padded length, packed R x W, shared R x W with each prompt once) and the head's
positions, the median seconds of scoring + loss over `--repeats` timed runs after a warm-up on
the same lengths, and the loss phase's memory: CUDA, the peak allocated above what was live
before it (`torch.cuda.max_memory_allocated` after a reset); CPU, the peak of torch.profiler's
memory events over the phase (allocator-independent), and the same above the parameter
gradients' bytes (which every layout allocates).

    python -m benchmarks.shared_prompt --device cpu --layers 2 --prompt_tokens 1024
    python -m benchmarks.shared_prompt --device cuda --dtype bfloat16 --layers 24 \\
        --attn flex_attention --out benchmarks/results/shared-prompt.csv

--capacity GIB (CUDA) instead finds, per layout, the longest prompt (to 256 tokens) whose loss
phase rises at most GIB above what was live before it: prompts double from 256 until one does
not fit (or runs out of memory), then bisect.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.lengths import draw_lengths
from grpo_kernels.hf import ROW_LAYOUTS, RowLayout, parse_row_layout


def synthetic_batch(groups: int, G: int, prompt: int, cap: int, vocab: int, seed: int) -> dict:
    """grpo_train's generation dict for `groups` prompts x G completions: input_ids,
    attention_mask [B, prompt + T] (completions right-padded to the longest), completion_mask
    [B, T], T. Token ids are drawn uniformly in [1, vocab)."""
    g = torch.Generator().manual_seed(seed)
    lengths = draw_lengths("lognormal", groups * G, cap, seed=seed, call=0)
    T = max(lengths)
    ids = torch.randint(1, vocab, (groups * G, prompt + T), generator=g)
    for k in range(groups):  # the G completions of a group share its prompt
        ids[k * G:(k + 1) * G, :prompt] = ids[k * G, :prompt]
    comp = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    attn = torch.cat([torch.ones(groups * G, prompt, dtype=torch.long), comp], dim=1)
    return dict(input_ids=ids, attention_mask=attn, completion_mask=comp, T=T)


def build_model(layers: int, attn: str, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.trainer_step import QWEN25_05B

    config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers},
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype).train()
    # set after loading: some transformers releases look a name with "flash" in it up on the
    # Hub when the config is built (e.g. torch_varlen's, registered but not a Hub kernel)
    model.config._attn_implementation = attn
    return model


def run_layout(model, batch: dict, layout: RowLayout, loss_fn, device: str) -> dict:
    """One scoring + loss on `layout`; returns seconds, positions and the loss phase's bytes."""
    from grpo_kernels import hf
    from grpo_train import batching

    mb, = batching.micro_batches({k: v.to(device) if torch.is_tensor(v) else v
                                  for k, v in batch.items()}, layout, 0, 0,
                                 model_config=model.config)
    adv = torch.linspace(-1, 1, mb.num_seqs, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = hf.causal_lm_logprobs(model, *mb.inputs, **mb.model_kwargs)
    sync()
    t1 = time.perf_counter()
    loss_bytes, prof = None, None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      profile_memory=True)
        prof.__enter__()
    loss, _ = hf.causal_lm_grpo_loss(model, *mb.inputs, adv, mb.mask, None, ref,
                                     loss_fn=loss_fn, cu_seqlens=mb.cu_seqlens,
                                     **mb.model_kwargs)
    loss.backward()
    sync()
    t2 = time.perf_counter()
    if device == "cuda":
        loss_bytes = torch.cuda.max_memory_allocated() - before
    else:
        from benchmarks.phases import allocated_rise

        prof.__exit__(None, None, None)
        loss_bytes = allocated_rise(prof)
    model.zero_grad(set_to_none=True)
    ids = mb.inputs[0]
    head = int(mb.completion_mask.sum()) if mb.packed is not None else mb.mask.numel()
    return {"scoring_s": t1 - t0, "loss_s": t2 - t1, "loss_rise_bytes": loss_bytes,
            "body_positions": ids.numel(), "head_positions": head, "loss": loss.item()}


def measure(args, layout: RowLayout, model, batch, loss_fn) -> dict:
    for _ in range(args.warmup):
        run_layout(model, batch, layout, loss_fn, args.device)
    runs = [run_layout(model, batch, layout, loss_fn, args.device) for _ in range(args.repeats)]
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    rise = max(r["loss_rise_bytes"] for r in runs)
    return {**runs[-1], "scoring_s": statistics.median(r["scoring_s"] for r in runs),
            "loss_s": statistics.median(r["loss_s"] for r in runs),
            "total_s": statistics.median(r["scoring_s"] + r["loss_s"] for r in runs),
            "loss_rise_gib": rise / 2**30, "rise_above_grads_gib": (rise - grads) / 2**30}


def fits(args, layout: RowLayout, model, prompt: int, loss_fn, budget_gib: float) -> bool:
    """Whether scoring + loss at `prompt` tokens stays within the budget (an out-of-memory
    error does not fit)."""
    batch = synthetic_batch(args.groups, args.num_generations, prompt, args.cap,
                            model.config.vocab_size, args.seed)
    try:
        rise = run_layout(model, batch, layout, loss_fn, args.device)["loss_rise_bytes"]
    except torch.OutOfMemoryError:
        rise = float("inf")
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return rise / 2**30 <= budget_gib


def capacity(args, layout: RowLayout, model, loss_fn) -> int:
    """The longest prompt (a multiple of 256) that `fits`; 0 if 256 does not."""
    low, high = 0, 256
    while fits(args, layout, model, high, loss_fn, args.capacity):
        low, high = high, 2 * high
    while high - low > 256:
        mid = (low + high) // 2 // 256 * 256
        low, high = (mid, high) if fits(args, layout, model, mid, loss_fn, args.capacity) \
            else (low, mid)
    return low


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser("python -m benchmarks.shared_prompt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attn", default="sdpa", help="sdpa, eager or flex_attention")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt_tokens", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--cap", type=int, default=1024)
    parser.add_argument("--layouts", nargs="+", default=list(ROW_LAYOUTS), choices=ROW_LAYOUTS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append the rows to this CSV")
    parser.add_argument("--capacity", type=float, default=None, metavar="GIB",
                        help="CUDA: the longest prompt whose loss phase fits GIB, per layout")
    args = parser.parse_args(argv)
    args.layouts = [parse_row_layout(x, "--layouts") for x in args.layouts]
    if args.capacity is not None and args.device != "cuda":
        parser.error("--capacity measures CUDA memory: use it with --device cuda")
    from grpo_kernels import FusedLinearGRPOLoss

    model = build_model(args.layers, args.attn, getattr(torch, args.dtype), args.device)
    loss_fn = FusedLinearGRPOLoss(beta=0.04)
    if args.capacity is not None:
        for layout in args.layouts:
            print(f"capacity: layout={layout} attn={args.attn} layers={args.layers} "
                  f"G={args.num_generations} budget={args.capacity} GiB: longest prompt "
                  f"{capacity(args, layout, model, loss_fn)} tokens", flush=True)
        return []
    rows = []
    for prompt in args.prompt_tokens:
        batch = synthetic_batch(args.groups, args.num_generations, prompt, args.cap,
                                model.config.vocab_size, args.seed)
        for layout in args.layouts:
            row = {"date": datetime.date.today().isoformat(), "machine": machine(args.device),
                   "commit": _commit(), "device": args.device, "dtype": args.dtype,
                   "attn": args.attn, "layers": args.layers, "G": args.num_generations,
                   "groups": args.groups, "prompt_tokens": prompt, "cap": args.cap,
                   "layout": layout,
                   "completion_tokens": int(batch["completion_mask"].sum()),
                   **measure(args, layout, model, batch, loss_fn)}
            rows.append(row)
            print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items() if k not in ("date", "machine", "commit")),
                  flush=True)
            if args.out:  # row by row: a run cut short keeps what it measured
                append_row(Path(args.out), row)
    return rows


def append_row(path: Path, row: dict) -> None:
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


def _commit() -> str:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
