"""The row of benchmarks.trainer_step: its columns (what ran, the phases' memory and time, the
environment, the kernel fallbacks), printing it and appending it to a CSV (`append_row`, also used
by benchmarks.capacity)."""

from __future__ import annotations

import csv
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

import torch

PHASES = ("generation", "scoring", "loss", "optimizer", "step")
PROFILED = ("scoring", "loss")  # CPU: allocator bytes from torch.profiler (benchmarks/phases.py)


def phase_columns(recorder, warmup: int, partial: bool = False) -> dict:
    """<phase>_peak_gib, <phase>_rise_gib and <phase>_s over the timed steps (after warm-up), and
    for the profiled phases <phase>_alloc_rise_gib (blank where not profiled). `partial` (a run
    stopped midway): running phases count as far as they got, missing ones are left blank."""
    summary = recorder.summary(skip_steps=warmup, include_open=partial)
    missing = [p for p in PHASES if p not in summary]
    if missing and not partial:  # a phase that never ran would silently read as zero memory
        raise RuntimeError(f"no memory recorded for phases {missing} in the timed steps")
    cols = {}
    for name in PHASES:
        if name not in summary:
            cols.update({f"{name}_peak_gib": "", f"{name}_rise_gib": "", f"{name}_s": ""})
            continue
        cols[f"{name}_peak_gib"] = round(summary[name]["peak_bytes"] / 2**30, 3)
        cols[f"{name}_rise_gib"] = round(summary[name]["rise_bytes"] / 2**30, 3)
        cols[f"{name}_s"] = round(summary[name]["seconds"], 3)
    for name in PROFILED:
        alloc = summary.get(name, {}).get("alloc_rise_bytes")
        cols[f"{name}_alloc_rise_gib"] = "" if alloc is None else round(alloc / 2**30, 3)
    return cols


# the trainer_step providers whose loss is grpo-kernels' linear-head loss (the others: TRL's own
# head and loss, or the PyTorch reference)
OURS = ("fused", "trl-kernels")


def route_columns(provider: str, taken: list[str]) -> dict:
    """The `loss_routes` column (each route our linear-head loss calls took, with its count of
    calls; empty when none ran) and, where they contradict the provider (ours and none taken,
    or another provider and ours taken), a `status` that says so."""
    counts = {path: taken.count(path) for path in sorted(set(taken))}
    out = {"loss_routes": "; ".join(f"{path} x{n}" for path, n in counts.items())}
    if (provider in OURS) != bool(taken):
        out["status"] = (f"wrong route: {provider} took "
                         f"{out['loss_routes'] or 'no route of grpo-kernels'}")
    return out


def append_row(path: Path, row: dict) -> None:
    """Appends `row` to the CSV; if its columns differ from the file's header (rows written
    before a column existed), the file is rewritten with the union, old rows left blank there."""
    rows, fields = [], list(row)
    if path.exists():
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            fields = list(reader.fieldnames or []) + [k for k in row
                                                      if k not in (reader.fieldnames or [])]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows + [row])


def versions(provider: str) -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import trl

        out["trl"] = trl.__version__
    except ImportError:
        out["trl"] = "not installed" if provider.startswith("trl") else ""
    return out


def describe(args, cuda: bool) -> dict:
    """The row's leading columns: what was run."""
    return {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "provider": {"fused": "grpo_train+fused", "reference": "grpo_train+reference",
                     "trl": "trl GRPOTrainer",
                     "trl-kernels": "grpo_kernels.trl GRPOTrainer"}[args.provider],
        "model": ("tiny qwen2 (smoke test)" if args.tiny else "Qwen2.5-0.5B shape, random")
        + ("" if args.num_layers is None else f", {args.num_layers} layers"),
        "num_generations": args.num_generations, "prompt_tokens": args.prompt_tokens,
        "completion_tokens": args.completion_tokens, "length_profile": args.length_profile,
        "padding_free": "off" if args.provider == "trl" else args.padding_free,
        "share_prompt": (args.share_prompt if args.provider in ("fused", "reference",
                                                                "trl-kernels")
                         and args.padding_free == "on" else "off"),
        "generation": "synthetic" if args.synthetic else
        "generate (padded)" if args.provider.startswith("trl") else args.generation,
        "attn_implementation": getattr(args, "attn_implementation", "auto"),
        "beta": args.beta,
        "warmup": args.warmup,
        "bf16_autocast": cuda and not args.no_bf16,
        "gradient_checkpointing": not args.no_gradient_checkpointing,
        "model_dtype": args.model_dtype,
    }


def environment(args, argv, device) -> dict:
    from benchmarks import device_label, git_commit

    return {"device": device_label(device), **versions(args.provider), "commit": git_commit(),
            "command": "python -m benchmarks.trainer_step " + shlex.join(
                sys.argv[1:] if argv is None else argv)}


def report(args, device, row: dict) -> None:
    """Adds the kernel_fallbacks column, prints the row and appends it to the device's CSV.

    kernel_fallbacks: kernel calls of this process that ran on the chunked PyTorch path because
    their Triton kernel failed to compile or launch; 0 in a healthy run, else the row did not
    time the kernels it names (`grpo_kernels.fallback_counts` says which variants)."""
    from benchmarks import device_slug
    from grpo_kernels import fallback_counts

    row["kernel_fallbacks"] = sum(fallback_counts().values())
    print(json.dumps(row, indent=1), flush=True)
    if not args.no_record:
        path = Path(args.out) / f"{device_slug(device)}-trainer.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        append_row(path, row)
        print(f"appended to {path}", flush=True)
