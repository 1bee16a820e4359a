"""Rows per chunk of the three-pass route against the four-pass route, on CPU.

    python -m benchmarks.chunk_rows --shapes qwen0.5b:1024,llama1b:512 \
        --rows 0,32,64,96,128,256,512,default [--rounds 2] [--threads 2] \
        [--dtype bfloat16] [--frozen] [--copy]

Times forward + backward of `grpo_kernels.fused_linear_grpo_loss` on the chunked backend (the
loss and inputs of `benchmarks/ab_cpu.py`: dapo, beta 0.04, ~25 % padding, an `nn.Parameter`
weight; `--frozen`: the weight does not require grad) with the chunk rows of the three-pass
route set: for each rows value R the route's budget holds exactly R whole rows (MIN_ROWS is
lifted; a 16-bit head's float32 d W and its weight-slice buffer are added to the budget, or
with `--copy` one float32 copy of the whole weight); R = 0 is the four-pass route
(GRPO_KERNELS_THREE_PASS=0) and `default` the route as it ships (CPU_BUDGET_BYTES and
MIN_ROWS). Each (round, shape, R) is one fresh process with OMP_WAIT_POLICY=passive: one
warm-up call, then `--reps` timed ones. It prints each process's wall and CPU seconds per call
(all threads: on a shared machine the CPU time varies less with the load than the wall time),
the route's log line and the 1-minute load; then, per shape and R, the median over rounds and
the ratio of CPU times to the four-pass route's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def budget_mib(rows: int, n: int, V: int, D: int, weight_dtype, want_dw: bool) -> str:
    """The GRPO_KERNELS_CHUNK_MIB text whose budget gives chunks of exactly `rows` rows for n
    tokens on the chunked backend (MIN_ROWS lifted by the caller), found through the backend's
    own rule (`loss_grad.chunk_rows`), not a copy of its bytes per row: the middle of the
    budgets that give `rows`, so that the text's rounding to 1e-6 MiB stays inside them."""
    from benchmarks.cases import env_vars
    from grpo_kernels.chunked import loss_grad
    from grpo_kernels.ops import route

    def got(budget: int) -> int:
        return loss_grad.chunk_rows(n, V, D, weight_dtype, budget, want_dw=want_dw)[0] or 0

    def least(r: int) -> int:  # the smallest budget that gives at least r rows
        lo, hi = 0, 1
        while got(hi) < r:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if got(mid) < r else (lo, mid)
        return hi

    want = min(rows, n)
    low = least(want)
    high = least(want + 1) if want < n else low + 2**20
    text = f"{(low + high) / 2 / 2**20:.6f}"
    with env_vars({route.CHUNK_ENV: text}):  # the budget as the route reads the text
        budget = route.chunk_budget_bytes("chunked")
    if got(budget) != want:
        raise ValueError(f"rows {rows}: no chunk budget gives {want} rows of V = {V}")
    return text


def worker(head: str, n: int, D: int, V: int, rows: str, dtype: str, frozen: bool, copy: bool,
           reps: int) -> dict:
    import torch

    import grpo_kernels
    from benchmarks import make_shape
    from benchmarks.cases import LossConfig, fused_inputs
    from grpo_kernels.chunked import loss_grad
    from grpo_kernels.ops import route

    lines = []
    log = logging.getLogger("grpo_kernels")
    log.setLevel(logging.INFO)
    log.addHandler(handler := logging.Handler())
    handler.emit = lambda record: lines.append(record.getMessage())
    cfg = LossConfig(backend="chunked")
    h, w, ids, adv, mask, old, ref = fused_inputs(make_shape(head, n, (D, V)),
                                                  getattr(torch, dtype), torch.device("cpu"), cfg)
    w = torch.nn.Parameter(w.detach(), requires_grad=not frozen)
    if rows == "0":
        os.environ[route.ENV] = "0"
    elif rows != "default":  # exactly R rows (a 16-bit head's d W and weight copy beside)
        loss_grad.MIN_ROWS = 1
        if copy:
            loss_grad.SLICE_BYTES = V * D * 4  # room for one float32 copy of the weight
        os.environ[route.CHUNK_ENV] = budget_mib(int(rows), int(mask.sum()), V, D,
                                                 w.dtype, want_dw=not frozen)
    times, cpu = [], []
    for i in range(1 + reps):
        h.grad = w.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        with grpo_kernels.force_backend("chunked"):
            loss = grpo_kernels.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref,
                                                       **cfg.ours())[0]
        loss.backward()
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return dict(head=head, N=n, rows=rows, dtype=dtype, frozen=frozen, copy=copy,
                tokens=int(mask.sum()), wall_s=statistics.median(times),
                cpu_s=statistics.median(cpu), route=lines, threads=torch.get_num_threads())


def main(argv=None) -> int:
    from .ab_cpu import parse_shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen0.5b:1024,llama1b:512", help="head:N items")
    ap.add_argument("--rows", default="0,32,64,96,128,256,512,default",
                    help="rows per chunk (0: the four-pass route; default: as shipped)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="timed calls per process")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--frozen", action="store_true", help="the weight does not require grad")
    ap.add_argument("--copy", action="store_true",
                    help="a 16-bit head: one float32 copy of the weight instead of slices")
    ap.add_argument("--worker", nargs=9, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        head, n, D, V, rows, dtype, frozen, copy, reps = args.worker
        print(json.dumps(worker(head, int(n), int(D), int(V), rows, dtype, frozen == "1",
                                copy == "1", int(reps))))
        return 0
    values = [r.strip() for r in args.rows.split(",")]
    if any(not (r.isdigit() or r == "default") for r in values):
        ap.error(f"--rows: expected rows (integers >= 0) or 'default', got {args.rows!r}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="passive",
               PYTHONPATH=str(ROOT))
    results = []
    for r in range(args.rounds):
        for head, n, D, V in parse_shapes(args.shapes):
            for rows in values if r % 2 == 0 else values[::-1]:
                load = os.getloadavg()[0]
                cmd = [sys.executable, "-m", "benchmarks.chunk_rows", "--worker", head, str(n),
                       str(D), str(V), rows, args.dtype, str(int(args.frozen)),
                       str(int(args.copy)), str(args.reps)]
                proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"rows {rows} at {head}:{n} failed:\n{proc.stderr[-3000:]}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row.update(round=r, load=round(load, 2))
                results.append(row)
                print(json.dumps(row), flush=True)
    for head, n, _, _ in parse_shapes(args.shapes):
        mine = [x for x in results if (x["head"], x["N"]) == (head, n)]
        med = {rows: {key: statistics.median(x[key] for x in mine if x["rows"] == rows)
                      for key in ("wall_s", "cpu_s")} for rows in values}
        for rows in values:
            ratio = med[rows]["cpu_s"] / med["0"]["cpu_s"] if "0" in med else float("nan")
            print(f"{head} N={n} rows {rows}: wall {med[rows]['wall_s']:.2f} s, CPU "
                  f"{med[rows]['cpu_s']:.2f} s, CPU / four-pass {ratio:.2f}")
    loads = [x["load"] for x in results]
    print(f"load (1 min) at the processes' starts: {min(loads)} to {max(loads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
