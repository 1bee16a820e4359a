"""Cold against warm decode attention, per sdpa backend: does a new KV length cost a build?

A decode step of transformers' dynamic cache attends over one more key than the step before, so
generation inside a training step meets a KV length the process has not seen at every step,
while a benchmark whose untimed call ran the same lengths first meets none. On sm_90 with cuDNN
>= 9.15 PyTorch may prefer cuDNN attention for `F.scaled_dot_product_attention`, and cuDNN builds
an execution graph per shape; if it runs here, each new length pays a graph build. This probe
times the first call at each new length (cold) against repeated calls at that length (warm), per
backend, and profiles which backend and kernels PyTorch's own choice runs.

The calls (Qwen2.5-0.5B's attention, one decode step, batch B = 8, bf16):
    gqa     q [B, 14, 1, 64], k, v [B, 2, L, 64], enable_gqa=True: how transformers calls sdpa
            when the batch has no padding mask (one prompt per batch, as benchmarks.generation's
            trainer-64 workload)
    masked  k, v repeated to [B, 14, L, 64] and a bool mask [B, 1, 1, L] (rows B/2.. left-padded
            by 8 positions): how it calls sdpa on a left-padded batch
Backends, chosen with `torch.nn.attention.sdpa_kernel`: default (PyTorch's choice), cudnn,
flash, efficient, math; one that has no kernel for the call gets a row saying so (and why).

Each (call, backend) block times K lengths no other block met (block i: L = first_L + i·K ..
first_L + (i+1)·K - 1), since the cuDNN graph cache is shared by the default choice and the
cudnn backend; its first call, at L = first_L + i·K - 1, is untimed (libraries, kernels).
Per length: one synchronized call (cold), then the median of --repeats synchronized calls
(warm). Reported per block: median cold ms, median warm ms and their ratio. Then torch.profiler
runs the default backend over --profile_lengths fresh lengths per call; its row names the sdpa
ops (with mean CPU ms per call: a graph build is host time) and CUDA kernels it saw.

    python -m benchmarks.sdpa_probe --device cuda --out results   # results/<device>-sdpa.csv
    python -m benchmarks.sdpa_probe --device cpu --tiny --no_record   # seconds, CPU backends
"""

from __future__ import annotations

import contextlib
import datetime as dt
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from grpo_train.flags import Parser, run_cli

from . import device_label, device_slug, git_commit
from .step_row import append_row

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
HEADS, KV_HEADS, HEAD_DIM, PAD = 14, 2, 64, 8  # Qwen2.5-0.5B's attention; the masked call's pad
# aten op of each backend, as the profiler names it (CPU flash: ..._flash_attention_for_cpu)
OPS = {"cudnn": "_scaled_dot_product_cudnn_attention",
       "flash": "_scaled_dot_product_flash_attention",
       "efficient": "_scaled_dot_product_efficient_attention",
       "math": "_scaled_dot_product_attention_math"}


def parse_backends(text: str, flag: str = "--sdpa_backends") -> list[SDPBackend]:
    """"flash,math" -> [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]; an unknown name is a
    ValueError naming `flag` and the known names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"{flag}: expected a comma list of {', '.join(BACKENDS)}, got {text!r}")
    return [BACKENDS[n] for n in names]


def backend_context(name: str):
    """sdpa_kernel restricted to one backend; "default" leaves PyTorch's choice."""
    return contextlib.nullcontext() if name == "default" else sdpa_kernel([BACKENDS[name]])


def inputs(call: str, B: int, L: int, device, dtype) -> dict:
    """sdpa's arguments for one decode step at KV length L (module docstring)."""
    q = torch.randn(B, HEADS, 1, HEAD_DIM, device=device, dtype=dtype)  # [B, 14, 1, 64]
    kv_heads = KV_HEADS if call == "gqa" else HEADS  # masked: repeat_kv's [B, 14, L, 64]
    k, v = (torch.randn(B, kv_heads, L, HEAD_DIM, device=device, dtype=dtype) for _ in "kv")
    if call == "gqa":
        return dict(query=q, key=k, value=v, enable_gqa=True)
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=device)  # [B, 1, 1, L]
    mask[B // 2:, ..., :min(PAD, L - 1)] = False  # left padding; each row keeps a key
    return dict(query=q, key=k, value=v, attn_mask=mask)


def timed_ms(args: dict, cuda: bool) -> float:
    """Milliseconds of one sdpa call, synchronized before and after on CUDA."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(**args)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def time_block(call: str, backend: str, lengths: list[int], args) -> dict:
    """Cold and warm ms per length of `lengths`, or status "no available kernel: <why>"."""
    cuda = args.device == "cuda"
    cold, warm = [], []
    with warnings.catch_warnings(record=True) as caught, backend_context(backend):
        warnings.simplefilter("always")  # PyTorch says why each backend was not used
        try:
            timed_ms(inputs(call, args.batch, lengths[0] - 1, args.device, args.dtype), cuda)
            for L in lengths:
                step = inputs(call, args.batch, L, args.device, args.dtype)
                cold.append(timed_ms(step, cuda))
                warm.append(statistics.median(timed_ms(step, cuda)
                                              for _ in range(args.repeats)))
        except RuntimeError as err:  # CUDA: "No available kernel", CPU: "No viable backend"
            text = str(err).split("\n")[0]
            if "available kernel" not in text and "viable backend" not in text:
                return dict(status=f"failed: {text[:200]}")
            why = " ".join(str(w.message).split("\n")[0] for w in caught)[:400]
            return dict(status=f"no available kernel: {why or text}")
    return dict(status="ok", cold_ms_median=round(statistics.median(cold), 4),
                warm_ms_median=round(statistics.median(warm), 4),
                cold_warm_ratio=round(statistics.median(cold) / statistics.median(warm), 2),
                cold_ms_max=round(max(cold), 4), cold_ms=";".join(f"{c:.3f}" for c in cold))


def profile_default(call: str, lengths: list[int], args) -> dict:
    """Which backend and CUDA kernels PyTorch's choice ran on `lengths` (cold), per torch.profiler:
    sdpa ops as name:calls:mean CPU ms, kernels by name (at most 12, 120 characters each)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    steps = [inputs(call, args.batch, L, args.device, args.dtype) for L in lengths]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for step in steps:
            timed_ms(step, cuda)
    averages = prof.key_averages()
    ops = [f"{e.key}:{e.count}:{e.cpu_time_total / e.count / 1e3:.3f}" for e in averages
           if "scaled_dot_product" in e.key and e.key != "aten::scaled_dot_product_attention"]
    kernels = sorted({e.key for e in averages if e.device_type == torch.autograd.DeviceType.CUDA})
    names = " ".join(ops)
    ran = [b for b, op in OPS.items() if op in names] or ["none seen"]
    return dict(status="profiled", ran=",".join(ran), cudnn_ran="cudnn" in ran,
                sdpa_ops=" ".join(ops), kernels=" | ".join(k[:120] for k in kernels[:12]))


def parse_args(argv):
    parser = Parser("python -m benchmarks.sdpa_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batch", type=int, default=8, help="B (the trainer-64 workload's 8)")
    parser.add_argument("--first_L", type=int, default=100, help="the first block's first length")
    parser.add_argument("--lengths", type=int, default=32, help="K: lengths per block")
    parser.add_argument("--repeats", type=int, default=5, help="warm calls per length")
    parser.add_argument("--profile_lengths", type=int, default=4,
                        help="cold lengths per call in the profiled pass")
    parser.add_argument("--calls", default="gqa,masked", help="comma list of gqa, masked")
    parser.add_argument("--backends", default="default," + ",".join(BACKENDS),
                        help=f"comma list of default, {', '.join(BACKENDS)}")
    parser.add_argument("--tiny", action="store_true",
                        help="4 lengths per block, 2 repeats, 2 profiled lengths (smoke tests)")
    parser.add_argument("--out", default="results", metavar="DIR",
                        help="appends to DIR/<device>-sdpa.csv")
    parser.add_argument("--no_record", action="store_true", help="print only, write no CSV")
    args = parser.parse_args(argv)
    if args.tiny:
        args.lengths, args.repeats, args.profile_lengths = 4, 2, 2
    for name in ("batch", "first_L", "lengths", "repeats", "profile_lengths"):
        if getattr(args, name) < (2 if name == "first_L" else 1):
            parser.error(f"--{name} must be >= {2 if name == 'first_L' else 1}, "
                         f"got {getattr(args, name)}")
    args.call_list, args.backend_list = args.calls.split(","), args.backends.split(",")
    if any(c not in ("gqa", "masked") for c in args.call_list):
        parser.error(f"--calls: expected a comma list of gqa, masked, got {args.calls!r}")
    if any(b != "default" and b not in BACKENDS for b in args.backend_list):
        parser.error(f"--backends: expected a comma list of default, {', '.join(BACKENDS)}, "
                     f"got {args.backends!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu)")
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    command = "python -m benchmarks.sdpa_probe " + shlex.join(sys.argv[1:] if argv is None
                                                              else argv)
    common = dict(date=dt.date.today().isoformat(), device=device_label(device),
                  commit=git_commit(), torch=torch.__version__, cudnn=cudnn or "",
                  command=command)
    print(f"# {common['device']} | {common['date']} | commit {common['commit']} | torch "
          f"{torch.__version__} | cuDNN {cudnn}\n# {command}")
    print(f"{'call':<7} {'backend':<10} {'lengths':>9} {'cold ms':>8} {'warm ms':>8} "
          f"{'cold/warm':>9}  status")
    path = Path(args.out) / f"{device_slug(device)}-sdpa.csv"
    K, first = args.lengths, args.first_L
    blocks = [(c, b) for c in args.call_list for b in args.backend_list]
    for i, (call, backend) in enumerate(blocks):
        lengths = list(range(first + i * K, first + (i + 1) * K))
        row = dict(call=call, backend=backend, first_L=lengths[0], last_L=lengths[-1],
                   **time_block(call, backend, lengths, args))
        print(f"{call:<7} {backend:<10} {f'{lengths[0]}-{lengths[-1]}':>9} "
              f"{row.get('cold_ms_median', ''):>8} {row.get('warm_ms_median', ''):>8} "
              f"{row.get('cold_warm_ratio', ''):>9}  {row['status']}", flush=True)
        record(args, path, common, row)
    first += len(blocks) * K  # the profiled lengths: none met before
    for j, call in enumerate(args.call_list):
        lengths = list(range(first + j * args.profile_lengths,
                             first + (j + 1) * args.profile_lengths))
        row = dict(call=call, backend="default", first_L=lengths[0], last_L=lengths[-1],
                   **profile_default(call, lengths, args))
        print(f"profiled {call} (default, L {lengths[0]}-{lengths[-1]}): ran {row['ran']}; "
              f"ops {row['sdpa_ops']}\n  kernels: {row['kernels'] or '(none: CPU)'}", flush=True)
        record(args, path, common, row)
    if not args.no_record:
        print(f"appended to {path}", flush=True)
    return 0


COLUMNS = ("call", "backend", "status", "first_L", "last_L", "batch", "dtype", "repeats",
           "cold_ms_median", "warm_ms_median", "cold_warm_ratio", "cold_ms_max", "cold_ms",
           "ran", "cudnn_ran", "sdpa_ops", "kernels")


def record(args, path: Path, common: dict, row: dict) -> None:
    """Appends the row with every column of COLUMNS (blank where it does not apply)."""
    if args.no_record:
        return
    row = dict(row, batch=args.batch, dtype=str(args.dtype).removeprefix("torch."),
               repeats=args.repeats)
    path.parent.mkdir(parents=True, exist_ok=True)
    append_row(path, {**common, **{c: row.get(c, "") for c in COLUMNS}})


if __name__ == "__main__":
    sys.exit(run_cli("python -m benchmarks.sdpa_probe", main))
