"""Per-kernel profile of one loss step: where the time of a provider's forward + backward goes.

    python -m benchmarks.profile_head --head llama8b --tokens 16384 \
        --providers ours ours-4pass reference --out benchmarks/results

For each provider of the kernel sweep (`providers.PROVIDERS`, fused linear head), at one shape:
warm-up steps, then `torch.profiler` over the timed steps. The table lists each kernel (on a
GPU: each CUDA kernel, cuBLAS and Triton alike; on a CPU: each ATen operator) with its calls
and self time per step, largest first, and the share of the step's device time it takes, so
that a per-kernel "before and after" is one run of this at two commits. Rows are appended to
`<out>/<device>-profile.csv` as they are measured (machine, date, commit, the route our loss's
calls took, empty for another library's, and command in each). A file written before a column
was added is first rewritten with the whole header, its rows' new cells empty.

What bounds the numbers: torch.profiler's own overhead (a few microseconds per launch), and on
a CPU the operators' self time, which counts their threads' wall time. Never a zero input: the
providers draw random inputs.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys
from collections import defaultdict
from pathlib import Path

import torch

from . import HEADS, RESULTS_DIR, device_slug, environment, make_shape, show_routes
from .providers import PROVIDERS, LossConfig

COLUMNS = ("device", "date", "commit", "provider", "route", "head", "N", "kernel",
           "calls_per_step", "ms_per_step", "share", "command")


def kernel_times(step, steps: int, device: torch.device) -> dict[str, tuple[int, float]]:
    """name -> (calls, self milliseconds), summed over `steps` calls of `step`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for evt in prof.key_averages():
        if device.type == "cuda":
            us = getattr(evt, "self_device_time_total", None)
            if us is None:  # torch < 2.4 spelled it with "cuda"
                us = evt.self_cuda_time_total
            on_device = getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA
            if not on_device or us <= 0:
                continue
        else:
            us = evt.self_cpu_time_total
            if us <= 0 or not evt.key.startswith(("aten::", "grpo_kernels::")):
                continue
        totals[evt.key][0] += evt.count
        totals[evt.key][1] += us / 1000.0
    return {k: (c, ms) for k, (c, ms) in totals.items()}


def profile(provider_key: str, head: str, tokens: int, dtype, device, warmup: int,
            steps: int) -> tuple[list[dict], str | None, str | None]:
    """One provider's rows (a row per kernel, per step, largest first), the route its calls
    took (None: not our loss) and why it is not the provider's route (None: it is)."""
    case = PROVIDERS[provider_key].build(make_shape(head, tokens), dtype, device, LossConfig())
    step = case.timed_fresh_step("fwd+bwd")
    for _ in range(warmup):  # compiles, autotunes and allocates outside the profile
        step()
    times = kernel_times(step, steps, device)
    route, wrong = case.route_check("fwd+bwd")  # the routes of the first call
    total = sum(ms for _, ms in times.values()) or 1.0
    ranked = sorted(times.items(), key=lambda kv: -kv[1][1])
    taken = route.removeprefix("route: ") if route else ""  # "three-pass", ...; "": none
    return [dict(provider=provider_key.split("/", 1)[1], route=taken, head=head, N=tokens,
                 kernel=name, calls_per_step=round(calls / steps, 2),
                 ms_per_step=round(ms / steps, 4), share=round(ms / total, 4))
            for name, (calls, ms) in ranked], route, wrong


def markdown(rows: list[dict], top: int) -> str:
    out = ["| provider | kernel | calls/step | ms/step | share |", "|---|---|---|---|---|"]
    shown: dict[str, int] = defaultdict(int)
    for r in rows:
        if shown[r["provider"]] >= top:
            continue
        shown[r["provider"]] += 1
        name = r["kernel"] if len(r["kernel"]) <= 70 else r["kernel"][:67] + "..."
        out.append(f"| {r['provider']} | `{name}` | {r['calls_per_step']} | "
                   f"{r['ms_per_step']:.3f} | {100 * r['share']:.1f} % |")
    return "\n".join(out)


def upgrade_csv(path: Path) -> str | None:
    """Rewrites an existing `path` whose header lacks some of COLUMNS with the whole header (the
    new cells of its rows empty), so that appended rows line up; returns why it cannot (a column
    this module does not write), else None."""
    if not path.exists() or not path.stat().st_size:
        return None
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or ()), list(reader)
    if header == list(COLUMNS):
        return None
    other = [c for c in header if c not in COLUMNS]
    if other:
        return f"{str(path)!r} has columns this module does not write: {', '.join(other)}"
    part = path.with_name(path.name + ".part")
    with part.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    part.replace(path)
    return None


def append_rows(path: Path, rows: list[dict], env: dict, command: str) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        for r in rows:
            writer.writerow(dict(r, device=env["device"], date=env["date"],
                                 commit=env["commit"], command=command))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default="llama8b", choices=tuple(HEADS))
    parser.add_argument("--tokens", type=int, default=16384, help="N, completion tokens")
    parser.add_argument("--providers", nargs="+", default=["ours", "reference"],
                        help="fused-linear providers of the kernel sweep")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="kernels shown per provider")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    for name in ("warmup", "steps", "tokens", "top"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    keys = [f"fused_linear/{p}" for p in args.providers]
    unknown = [k for k in keys if k not in PROVIDERS]
    if unknown:
        parser.error(f"--providers: unknown {unknown[0].split('/')[1]!r}; fused-linear providers "
                     f"are {sorted(k.split('/')[1] for k in PROVIDERS if 'fused' in k)}")
    device = torch.device(args.device)
    env = dict(environment(device), date=datetime.date.today().isoformat())
    command = "python -m benchmarks.profile_head " + " ".join(argv or sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{device_slug(device)}-profile.csv"
    problem = upgrade_csv(path)
    if problem:
        parser.error(f"--out: {problem}; move it aside or pass another --out")
    show_routes()  # stderr: which route each provider's loss took
    failed = []
    for key in keys:
        why = PROVIDERS[key].unavailable(device)
        if why:
            print(f"{key}: skipped ({why})")
            continue
        rows, route, wrong = profile(key, args.head, args.tokens, getattr(torch, args.dtype),
                                     device, args.warmup, args.steps)
        name = key.split("/", 1)[1]
        if wrong:  # a profile of another route than the provider's name says: not written
            print(f"{name}: {wrong}; its rows are not written", flush=True)
            failed.append(name)
            continue
        append_rows(path, rows, env, command)
        print((f"{name}: {route}\n\n" if route else "") + markdown(rows, args.top), flush=True)
    print(f"rows: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
