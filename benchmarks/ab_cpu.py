"""A/B timing of the fused linear loss on CPU between two source trees (e.g. two commits).

    python benchmarks/ab_cpu.py A_TREE B_TREE [--rounds 5] [--threads N]

Times `fused_linear/ours` forward + backward (the chunked backend, float32, the quick sweep's
loss: dapo, beta 0.04, eps 0.2, old/ref log-probs, ~25 % padding) at the quick sweep's fused
shapes (tiny and small heads, N = 256 and 1024). Each (round, shape, tree) is one fresh process
with PYTHONPATH set to that tree: two warm-up calls, then 15 (tiny), 5 (small N = 256) or 3
(small N = 1024) timed calls, whose median it prints. The trees take turns, in the opposite
order every other round; the summary is the median over rounds of those medians, per shape.
A tree made with `git worktree add DIR
COMMIT` gives an older commit's code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = [("tiny", 256, 15), ("tiny", 1024, 15), ("small", 256, 5), ("small", 1024, 3)]


def worker(head: str, n: int, reps: int) -> dict:
    import torch

    import grpo_kernels
    from benchmarks import make_shape
    from benchmarks.providers import PROVIDERS, LossConfig

    case = PROVIDERS["fused_linear/ours"].build(make_shape(head, n), torch.float32,
                                                torch.device("cpu"), LossConfig(backend="chunked"))
    # timed here, not with Case.timed_fresh_step: the tree under test may predate it
    step, times = case.step("fwd+bwd"), []
    for i in range(2 + reps):  # two warm-up calls, then the timed ones
        for t in case.leaves:
            t.grad = None
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return dict(tree=grpo_kernels.__file__, head=head, N=n, reps=reps,
                median_ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3,
                threads=torch.get_num_threads())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", help="A_TREE B_TREE: source trees (PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (0: unset)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        head, n, reps = args.worker
        print(json.dumps(worker(head, int(n), int(reps))))
        return 0
    results = []
    for r in range(args.rounds):
        for head, n, reps in SHAPES:
            for tree in args.trees if r % 2 == 0 else args.trees[::-1]:
                env = dict(os.environ, PYTHONPATH=tree)
                if args.threads:
                    env["OMP_NUM_THREADS"] = str(args.threads)
                load = os.getloadavg()[:2]
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                       head, str(n), str(reps)], cwd=tree, env=env,
                                      capture_output=True, text=True, check=True)
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row.update(name=tree, round=r, load=load)
                results.append(row)
                print(json.dumps(row), flush=True)
    for head, n, _ in SHAPES:
        med = {t: statistics.median(x["median_ms"] for x in results
                                    if x["name"] == t and (x["head"], x["N"]) == (head, n))
               for t in args.trees}
        print(head, n, {t: round(v, 2) for t, v in med.items()},
              "B / A", round(med[args.trees[-1]] / med[args.trees[0]], 3))
    print("load (1 min) during the run:", min(x["load"][0] for x in results), "to",
          max(x["load"][0] for x in results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
