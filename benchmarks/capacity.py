"""Capacity: the longest completion whose loss phase (scoring + forward + backward) fits a memory
budget, for each provider, as TRL 1.15's release notes measure their fused LM head.

    python -m benchmarks.capacity --providers trl trl-kernels fused --budget_gib 6 \\
        --num_layers 2 --out benchmarks/results
    python -m benchmarks.capacity --providers fused --layouts packed padded \\
        --length_profile long_tailed --num_generations 8 --budget_gib 6 --num_layers 2

Every probe is one `benchmarks.trainer_step` run in its own process: one step, no warm-up, G =
--num_generations completions, synthetic completions (random tokens made without the model, so
generation does not dominate), beta and the rest as trainer_step. With `--length_profile fixed`
(the default) every completion is the probed length long. With `--length_profile long_tailed`
(trainer_step's `lognormal` profile, benchmarks/lengths.py: median a third of the cap) the probed
length is the cap (max_completion_length) and the G lengths are drawn under it, the same draw
(--seed, first call) for every probe, so they scale with the cap. --layouts runs each provider's
search once per layout: `padded` (--padding_free off), `packed` (--padding_free on,
--share_prompt off) or `shared` (packed with the group's prompt once); TRL's own trainer pads
only; without --layouts each provider runs trainer_step's default (TRL padded, the others shared
where the model allows it). A probe fits when it finishes and the higher of
its scoring and loss phase peaks is within the budget: on CUDA `max_memory_allocated`, on CPU the
process' RSS (trainer_step's --max_rss_gib stops a probe that passes it; each probe runs with
glibc's malloc thresholds fixed, benchmarks/allocator.py, and the row's `malloc` column says so).
The length doubles from --start while it fits (or halves while it does not, down to 64), then
bisects between the last fit and the first miss until they are within --resolution of each other
(rounded to 64 tokens). One row per provider and layout is appended to
<out>/<device>-capacity.csv: the longest length (or cap) that fit, every probe's length and peak,
the length profile, the layout that ran (as the probes' trainer_step rows report it), the lengths
drawn at the capacity, the machine, versions, commit and command."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from grpo_kernels.hf import ROW_LAYOUTS, RowLayout, parse_row_layout
from grpo_train.flags import Parser, run_cli

ROOT = Path(__file__).resolve().parent.parent
PROVIDERS = ("fused", "trl", "trl-kernels")
SUPPORTS = {"fused": tuple(RowLayout), "trl": (RowLayout.PADDED,), "trl-kernels": tuple(RowLayout)}
LAYOUT_FLAGS = {RowLayout.PADDED: ["--padding_free", "off"],
                RowLayout.PACKED: ["--padding_free", "on", "--share_prompt", "off"],
                RowLayout.SHARED: ["--padding_free", "on", "--share_prompt", "on"]}
# --length_profile: long_tailed is trainer_step's lognormal profile (benchmarks/lengths.py)
PROFILES = {"fixed": "fixed", "long_tailed": "lognormal", "lognormal": "lognormal"}


def layout_ran(row: dict) -> RowLayout | None:
    """The row layout a trainer_step row says ran (None when there is no row)."""
    if "padding_free" not in row:
        return None
    if row["padding_free"] == "off":
        return RowLayout.PADDED
    return RowLayout.SHARED if row.get("share_prompt") == "on" else RowLayout.PACKED


def drawn_lengths(args, length: int) -> list[int]:
    """The completion lengths a probe at `length` (the cap) runs: its one step's draw."""
    from benchmarks import lengths

    profile = PROFILES[getattr(args, "length_profile", "fixed")]
    return lengths.draw_lengths(profile, args.num_generations, length, args.seed, call=0)


def probe(args, provider: str, length: int) -> dict:
    """One trainer_step run at `length` (the cap under a long-tailed profile): {length, fits,
    peak_gib, status, malloc, layout, lengths}; args.layout (None: the provider's default)."""
    profile = PROFILES[getattr(args, "length_profile", "fixed")]
    layout = getattr(args, "layout", None)
    layout = None if layout is None else parse_row_layout(layout)
    cmd = [sys.executable, "-m", "benchmarks.trainer_step", "--provider", provider,
           "--synthetic", "--length_profile", profile, "--completion_tokens", str(length),
           "--num_generations", str(args.num_generations), "--prompt_tokens",
           str(args.prompt_tokens), "--warmup", "0", "--steps", "1", "--no_record",
           "--device", args.device, "--beta", str(args.beta), "--seed", str(args.seed)]
    cmd += LAYOUT_FLAGS[layout] if layout is not None else []
    if args.num_layers is not None:
        cmd += ["--num_layers", str(args.num_layers)]
    if args.tiny:
        cmd += ["--tiny", "--backend", "chunked"]
    if args.device == "cpu":
        cmd += ["--max_rss_gib", str(args.budget_gib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    out = "\n" + proc.stdout  # the row is the last indented JSON object printed
    start, end = out.rfind("\n{\n"), out.rfind("\n}")
    row = json.loads(out[start:end + 2]) if 0 <= start < end else {}
    peaks = [row.get(f"{p}_peak_gib") for p in ("scoring", "loss")]
    peak = max((x for x in peaks if isinstance(x, (int, float))), default=None)
    status = row.get("status") or f"failed (exit {proc.returncode}): {proc.stderr[-300:]!r}"
    drawn, ran = drawn_lengths(args, length), layout_ran(row)
    if status == "ok" and layout is not None and ran != layout:
        status = f"failed: asked for layout {layout}, the probe ran {ran or 'unknown'}"
    mean = round(statistics.mean(drawn), 1)  # as trainer_step rounds it
    if status == "ok" and row["completion_tokens_mean"] != mean:
        status = (f"failed: completions averaged {row['completion_tokens_mean']} tokens, "
                  f"drawn {mean}")
    fits = status == "ok" and peak is not None and peak <= args.budget_gib
    result = dict(length=length, fits=fits, peak_gib=peak, status=status,
                  malloc=row.get("malloc", ""), layout=ran or "", lengths=drawn)
    print(json.dumps({"provider": provider, **result}), flush=True)
    return result


def search(args, provider: str) -> tuple[int | None, list[dict]]:
    """(longest fitting length or None, every probe) for one provider: from --start, doubling
    while it fits (or halving, down to 64 tokens, while it does not), then bisecting."""
    probes = [probe(args, provider, args.start)]
    if probes[-1]["fits"]:
        lo = hi = args.start
        while probes[-1]["fits"] and hi < args.max_length:
            lo, hi = hi, min(2 * hi, args.max_length)
            probes.append(probe(args, provider, hi))
        if probes[-1]["fits"]:  # fits up to --max_length
            return hi, probes
    else:
        lo = hi = args.start
        while not probes[-1]["fits"]:
            if lo // 2 < 64:
                return None, probes
            lo, hi = lo // 2, lo
            probes.append(probe(args, provider, lo))
    while hi > lo * (1 + args.resolution):
        mid = max(lo + 64, (lo + hi) // 2 // 64 * 64)
        if mid >= hi:
            break
        probes.append(probe(args, provider, mid))
        lo, hi = (mid, hi) if probes[-1]["fits"] else (lo, mid)
    return lo, probes


def main(argv=None) -> int:
    parser = Parser("python -m benchmarks.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--budget_gib", type=float, required=True,
                        help="memory budget of the loss phase (CPU: RSS; CUDA: allocated)")
    parser.add_argument("--start", type=int, default=1024, help="first completion length")
    parser.add_argument("--max_length", type=int, default=131072)
    parser.add_argument("--resolution", type=float, default=0.125,
                        help="stop bisecting when the miss is within this fraction of the fit")
    parser.add_argument("--num_generations", type=int, default=2)
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=None,
                        help="decoder layers of the Qwen2.5-0.5B shape (default 24)")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--tiny", action="store_true", help="tiny model (a smoke test)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--length_profile", default="fixed", choices=tuple(PROFILES),
                        help="fixed: every completion the probed length; long_tailed (or "
                             "lognormal, its name in benchmarks/lengths.py): lengths drawn "
                             "under the probed cap, median a third of it")
    parser.add_argument("--layouts", nargs="+", choices=ROW_LAYOUTS, default=None,
                        help="one search per provider and layout: padded, packed (the prompt "
                             "per completion) or shared (the group's prompt once); default: "
                             "trainer_step's (trl padded, the others shared)")
    parser.add_argument("--seed", type=int, default=0,
                        help="model weights and (long_tailed) the one draw every probe uses")
    parser.add_argument("--out", default="results", metavar="DIR")
    parser.add_argument("--no_record", action="store_true")

    def run() -> int:
        args = parser.parse_args(argv)
        args.layouts = [parse_row_layout(x, "--layouts") for x in args.layouts or []] or None
        if args.budget_gib <= 0 or args.start < 64 or args.max_length < args.start:
            parser.error("need --budget_gib > 0, --start >= 64 and --max_length >= --start")
        if args.num_generations < 2:
            parser.error(f"--num_generations must be >= 2, got {args.num_generations}")
        for provider in args.providers:
            for layout in args.layouts or [None]:
                if layout is not None and layout not in SUPPORTS[provider]:
                    parser.error(f"{provider} cannot run the {layout} layout (it runs "
                                 f"{', '.join(SUPPORTS[provider])})")
        for provider in args.providers:
            for layout in args.layouts or [None]:
                one = argparse.Namespace(**vars(args), layout=layout)
                length, probes = search(one, provider)
                record(one, argv, provider, length, probes)
        return 0

    return run_cli("python -m benchmarks.capacity", run, argv)


def record(args, argv, provider: str, length: int | None, probes: list[dict]) -> None:
    import torch

    from benchmarks import device_label, device_slug, git_commit
    from benchmarks.step_row import append_row, versions

    device = torch.device(args.device)
    row = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "provider": provider, "budget_gib": args.budget_gib,
        "memory_kind": "max_memory_allocated" if args.device == "cuda" else "RSS",
        # trainer_step re-executes each probe with glibc's thresholds fixed (allocator.py)
        "malloc": "; ".join(sorted({p["malloc"] for p in probes if p.get("malloc")})),
        "capacity_tokens": length if length is not None else "",
        "model": ("tiny qwen2 (smoke test)" if args.tiny else "Qwen2.5-0.5B shape, random") + (
            "" if args.num_layers is None else f", {args.num_layers} layers"),
        "num_generations": args.num_generations, "prompt_tokens": args.prompt_tokens,
        "beta": args.beta,
        "probes": " ".join(f"{p['length']}:{p['peak_gib']}:{'fit' if p['fits'] else 'miss'}"
                           for p in probes),
        "device": device_label(device), **versions(provider), "commit": git_commit(),
        "command": "python -m benchmarks.capacity " + shlex.join(
            sys.argv[1:] if argv is None else argv),
        # columns added with the long-tailed profile and the layouts (blank in older rows)
        "length_profile": PROFILES[args.length_profile],
        "layout": "; ".join(sorted({p["layout"] for p in probes if p.get("layout")}))
        or (args.layout or ""),
        "capacity_lengths": " ".join(map(str, next(
            (p.get("lengths", []) for p in probes if p["length"] == length and p["fits"]), []))),
    }
    print(json.dumps(row, indent=1), flush=True)
    if not args.no_record:
        path = Path(args.out) / f"{device_slug(device)}-capacity.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        append_row(path, row)


if __name__ == "__main__":
    sys.exit(main())
