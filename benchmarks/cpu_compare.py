"""CPU comparison of the fused linear GRPO loss: eager reference vs Liger vs ours (chunked path).

    python -m benchmarks.cpu_compare [--real-head] [--repeats 5] [--out cpu-compare.csv]

Every provider computes the same loss (TRL's dapo, beta 0.04, eps 0.2, old/ref log-probs given,
~25% trailing padding; inputs from `benchmarks.providers.fused_inputs`, never zeros), forward +
backward, in its own process (so one provider's heap and caches cannot flatter or burden
another's). Per process: one warm-up call, then `--repeats` timed calls (best and median wall
time), and the peak memory above the process's footprint once the inputs exist: peak resident
set size during the warm-up and timed calls (Linux VmHWM, reset through /proc/self/clear_refs
after the inputs are built and freed heap is trimmed) minus the RSS just before. It counts
everything the process touched (gradients, allocator overhead, GEMM packing buffers). Live tensor
storage (`measure.LiveStorageTracker`) is not used: it cannot see inside grpo_kernels' custom
operators, so it would under-count ours.

Providers: eager = grpo_kernels.reference.fused_linear_grpo_loss ([N, V] logits, autograd);
liger = liger_kernel's LigerFusedLinearGRPOLoss (chunked, gradients in forward; compiled=False on
CPU); ours = grpo_kernels.fused_linear_grpo_loss forced onto the chunked PyTorch backend.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROVIDER_KEYS = {"eager": "fused_linear/reference", "liger": "fused_linear/liger",
                 "ours": "fused_linear/ours"}
TARGET_SHAPE = (4096, 128, 32768)  # the CPU targets' shape (synthetic head)
REAL_HEAD = (4096, 896, 151936)  # Qwen2.5-0.5B's lm head
MiB = 2**20
FIELDS = ["utc", "machine", "cpus", "torch_threads", "torch", "commit", "load_1m_5m",
          "provider", "N", "D", "V", "dtype", "repeats", "best_s", "median_s",
          "warmup", "rss_peak_above_inputs_mib", "inputs_mib", "note",
          "command"]


class OneLineErrors(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected NxDxV with positive integers, got {text!r}")
    return tuple(int(p) for p in parts)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back so RSS starts honest
    except (OSError, AttributeError):
        pass


def worker(provider: str, shape: tuple[int, int, int], dtype_name: str, repeats: int,
           warmup: int) -> dict:
    """Runs in a fresh process: build inputs, time fwd+bwd, measure peak memory."""
    import torch

    from benchmarks import make_shape
    from benchmarks.providers import PROVIDERS, LossConfig

    N, D, V = shape
    head = "qwen0.5b" if (D, V) == REAL_HEAD[1:] else "synthetic"
    cfg = LossConfig(backend="chunked" if provider == "ours" else None)
    case = PROVIDERS[PROVIDER_KEYS[provider]].build(
        make_shape(head, N, (D, V)), getattr(torch, dtype_name), torch.device("cpu"), cfg)
    call = case.timed_fresh_step("fwd+bwd")

    _trim_heap()
    base_kib = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    for _ in range(warmup):
        call()  # first-call allocations, thread pools
    times = [call() for _ in range(repeats)]
    rss_peak = (_status_kib("VmHWM") - base_kib) * 1024
    return dict(provider=provider, N=N, D=D, V=V, dtype=dtype_name, repeats=repeats,
                warmup=warmup, best_s=min(times), median_s=statistics.median(times),
                rss_peak_above_inputs_mib=rss_peak / MiB,
                inputs_mib=case.input_bytes / MiB, note=case.note,
                torch_threads=torch.get_num_threads())


def _run_worker(provider, shape, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.cpu_compare", "--worker", provider,
           "--shapes", "x".join(map(str, shape)), "--dtype", args.dtype,
           "--repeats", str(args.repeats if shape != REAL_HEAD else args.real_head_repeats),
           "--warmup", str(args.warmup if shape != REAL_HEAD else 0)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(provider=provider, N=shape[0], D=shape[1], V=shape[2], dtype=args.dtype,
                    note=f"failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _machine() -> str:
    from benchmarks import cpu_model

    return cpu_model()


def _verdict(rows: list[dict]) -> list[str]:
    """The CPU targets (time against Liger and eager, peak memory) at TARGET_SHAPE, from this
    run's rows."""
    by = {r["provider"]: r for r in rows if (r["N"], r["D"], r["V"]) == TARGET_SHAPE
          and "best_s" in r}
    if not {"ours", "eager", "liger"} <= by.keys():
        return ["targets: not evaluated (need eager, liger and ours at 4096x128x32768)"]
    o, e, lg = by["ours"], by["eager"], by["liger"]
    mem = "rss_peak_above_inputs_mib"
    checks = [("time <= 1.1 x liger", o["median_s"] / lg["median_s"], 1.1),
              ("time <= 1.5 x eager", o["median_s"] / e["median_s"], 1.5),
              ("peak memory <= liger", o[mem] / lg[mem], 1.0),
              ("peak memory <= eager / 4", o[mem] / e[mem], 0.25)]
    return [f"target {name}: ratio {ratio:.2f} -> {'met' if ratio <= limit else 'NOT met'}"
            for name, ratio, limit in checks]


def main(argv=None) -> int:
    ap = OneLineErrors(prog="python -m benchmarks.cpu_compare", allow_abbrev=False,
                       description=__doc__.split("\n\n")[0])
    ap.add_argument("--providers", nargs="+", choices=sorted(PROVIDER_KEYS),
                    default=["eager", "liger", "ours"])
    ap.add_argument("--shapes", nargs="+", type=_shape, default=[TARGET_SHAPE],
                    help="NxDxV problems (default 4096x128x32768)")
    ap.add_argument("--real-head", "--real_head", action="store_true",
                    help=f"also run N={REAL_HEAD[0]} on Qwen2.5-0.5B's head "
                         f"(D={REAL_HEAD[1]}, V={REAL_HEAD[2]}; eager peaked at 12 GB RSS)")
    ap.add_argument("--real-head-providers", "--real_head_providers", nargs="+",
                    choices=sorted(PROVIDER_KEYS), default=["eager", "ours"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls after one warm-up")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed calls before the timed ones (none at the real head)")
    ap.add_argument("--real-head-repeats", "--real_head_repeats", type=int, default=1,
                    help="timed calls at the real head (no warm-up there: each takes minutes)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--out", default="cpu-compare.csv",
                    help="CSV file to append rows to, or a directory (then DIR/cpu-compare.csv)")
    ap.add_argument("--worker", choices=sorted(PROVIDER_KEYS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.real_head_repeats < 1 or args.warmup < 0:
        ap.error("--repeats and --real-head-repeats must be >= 1, --warmup >= 0")
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker(args.worker, args.shapes[0], args.dtype, args.repeats,
                                args.warmup)))
        return 0

    import torch

    from benchmarks import git_commit

    shapes = list(args.shapes) + ([REAL_HEAD] if args.real_head else [])
    command = "python -m benchmarks.cpu_compare " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]))
    common = dict(machine=_machine(), cpus=os.cpu_count(), torch=torch.__version__,
                  commit=git_commit(), command=command.strip())
    rows = []
    for shape in shapes:
        for provider in args.real_head_providers if shape == REAL_HEAD else args.providers:
            load = "/".join(f"{x:.2f}" for x in os.getloadavg()[:2])
            row = {**common, **_run_worker(provider, shape, args), "load_1m_5m": load}
            row["utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            rows.append(row)
            print(_format(row), flush=True)
    out = Path(args.out)
    if out.is_dir():
        out = out / "cpu-compare.csv"
    new = not out.exists() or out.stat().st_size == 0
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(_rounded(r) for r in rows)
    for line in _verdict(rows):
        print(line)
    print(f"rows appended to {out}")
    return 0


def _rounded(row: dict) -> dict:
    """Seconds to the millisecond, MiB to 0.1 MiB."""
    return {k: (f"{v:.3f}" if k.endswith("_s") else f"{v:.1f}") if isinstance(v, float) else v
            for k, v in row.items()}


def _format(r: dict) -> str:
    head = f"{r['provider']:>6} N={r['N']} D={r['D']} V={r['V']}"
    if "best_s" not in r:
        return f"{head}: {r.get('note', '')}"
    return (f"{head}: best {r['best_s']:.3f} s, median {r['median_s']:.3f} s, peak RSS above "
            f"inputs {r['rss_peak_above_inputs_mib']:.0f} MiB (load {r['load_1m_5m']})")


if __name__ == "__main__":
    sys.exit(main())
