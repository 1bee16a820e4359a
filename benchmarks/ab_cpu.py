"""A/B timing of the fused linear loss on CPU between source trees (e.g. two commits), with the
eager reference as an optional third column.

    python benchmarks/ab_cpu.py A_TREE B_TREE [--shapes tiny:256,qwen0.5b:1024] [--rounds 5]
                                [--threads N] [--reference] [--passive]

Times forward + backward of `grpo_kernels.fused_linear_grpo_loss` on the chunked backend
(float32; the quick sweep's loss: dapo, beta 0.04, eps 0.2, old/ref log-probs, ~25 % padding,
inputs from `benchmarks.cases.fused_inputs`) with the weight an `nn.Parameter`, as a model's
lm_head is, at `--shapes`: head:N items, heads from `benchmarks.HEADS` (default: the quick
sweep's fused shapes, tiny and small at N = 256 and 1024). `--reference` adds
`grpo_kernels.reference.fused_linear_grpo_loss` (materialized [N, V] logits, eager) from
B_TREE as a third column.

Each (round, shape, column) is one fresh process with PYTHONPATH set to its tree: one or two
warm-up calls, then `reps_for` timed calls (15 at the tiny head, 2 at the real ones: a process
at a real head takes ~15-60 s on 2 cores, more under load). It prints the calls' median wall
time, their median CPU time (all threads; with `--passive`, OMP_WAIT_POLICY=passive, waiting
threads sleep instead of spinning, so on a shared machine the CPU time varies less with the
load than the wall time) and the 1-minute load average at its start. The columns take turns,
in the opposite order every other round; the summary is the median over rounds of those
medians, per shape, the ratios B / A (and B / eager) of the wall times, and the load's range
over the run. A tree made with `git worktree add DIR COMMIT` gives an older commit's code; the
worker needs only `grpo_kernels` and `benchmarks.cases` there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SHAPES = "tiny:256,tiny:1024,small:256,small:1024"
REFERENCE = "eager"  # the reference's column name


def reps_for(n: int, D: int, V: int) -> int:
    """Timed calls per process: ~4·10^10 multiply-adds of N·D·V products in all, at least 2 and
    at most 15 (tiny: 15; small: 9 at N = 256, 2 at N = 1024; the real heads: 2)."""
    return max(2, min(15, round(4e10 / (n * D * V))))


def worker(provider: str, head: str, n: int, D: int, V: int, reps: int) -> dict:
    import torch

    import grpo_kernels
    from benchmarks import make_shape
    from benchmarks.cases import LossConfig, fused_inputs
    from grpo_kernels import reference

    cfg = LossConfig(backend="chunked")
    h, w, ids, adv, mask, old, ref = fused_inputs(make_shape(head, n, (D, V)), torch.float32,
                                                  torch.device("cpu"), cfg)
    w = torch.nn.Parameter(w.detach())  # a model's lm_head weight
    fn = (reference.fused_linear_grpo_loss if provider == REFERENCE
          else grpo_kernels.fused_linear_grpo_loss)
    times, cpu = [], []
    warm = 2 if reps > 5 else 1
    for i in range(warm + reps):
        h.grad = w.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        with grpo_kernels.force_backend("chunked"):
            loss = fn(h, w, ids, adv, mask, old, ref, **cfg.ours())[0]
        loss.backward()
        if i >= warm:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return dict(tree=grpo_kernels.__file__, head=head, N=n, reps=reps,
                median_ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3,
                cpu_ms=statistics.median(cpu) * 1e3, threads=torch.get_num_threads())


def parse_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """"head:N,..." -> [(head, N, D, V)], heads from benchmarks.HEADS."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import HEADS

    shapes = []
    for item in text.split(","):
        head, _, n = item.strip().partition(":")
        if head not in HEADS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--shapes: expected head:N with a head of {', '.join(HEADS)} "
                             f"and N >= 1, got {item!r}")
        shapes.append((head, int(n), *HEADS[head]))
    return shapes


def run_one(name: str, tree: str, shape, threads: int, passive: bool) -> dict:
    head, n, D, V = shape
    env = dict(os.environ, PYTHONPATH=tree)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if passive:
        env["OMP_WAIT_POLICY"] = "passive"
    load = os.getloadavg()[0]
    provider = REFERENCE if name == REFERENCE else "ours"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", provider, head,
                           str(n), str(D), str(V), str(reps_for(n, D, V))], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} at {head}:{n} failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row.update(name=name, load=round(load, 2))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", help="A_TREE B_TREE: source trees (PYTHONPATH)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="head:N items, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (0: unset)")
    ap.add_argument("--reference", action="store_true",
                    help="add the eager reference (B_TREE's) as a third column")
    ap.add_argument("--passive", action="store_true",
                    help="OMP_WAIT_POLICY=passive: waiting threads sleep instead of spinning")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        provider, head, *nums = args.worker
        print(json.dumps(worker(provider, head, *map(int, nums))))
        return 0
    if len(args.trees) != 2:
        ap.error("expected two trees, A_TREE B_TREE")
    shapes = parse_shapes(args.shapes)
    columns = [(t, t) for t in args.trees] + ([(REFERENCE, args.trees[-1])] * args.reference)
    print("load (1, 5, 15 min) at the start:", os.getloadavg(), flush=True)
    results = []
    for r in range(args.rounds):
        for shape in shapes:
            for name, tree in columns if r % 2 == 0 else columns[::-1]:
                row = run_one(name, tree, shape, args.threads, args.passive)
                row.update(round=r)
                results.append(row)
                print(json.dumps(row), flush=True)
    a, b = args.trees
    for head, n, _, _ in shapes:
        mine = [x for x in results if (x["head"], x["N"]) == (head, n)]
        wall, cpu = ({name: statistics.median(x[key] for x in mine if x["name"] == name)
                      for name, _ in columns} for key in ("median_ms", "cpu_ms"))
        ratios = f"B / A {wall[b] / wall[a]:.3f}"
        if args.reference:
            ratios += f", B / eager {wall[b] / wall[REFERENCE]:.3f}"
        print(f"{head} N={n}", {k: round(v, 1) for k, v in wall.items()}, ratios,
              "| CPU ms", {k: round(v, 1) for k, v in cpu.items()})
    loads = [x["load"] for x in results]
    print(f"load (1 min) at the processes' starts: {min(loads)} to {max(loads)}; at the end:",
          os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
