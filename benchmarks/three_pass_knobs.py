"""Race of the three-pass route's two launch knobs at a real head: the chunk budget (rows per
chunk) and the row kernels (the forward and backward kernels, or the one kernel that does both:
`linear_loss_grad(fused_rows=True)`), for the defaults of `kernels.linear_loss_grad`.

    python -m benchmarks.three_pass_knobs --heads llama8b,qwen0.5b --tokens 16384

Why. Per chunk of C rows the route moves about 18·C·V bytes through the row passes (cuBLAS
writes the float32 logits, the forward reads them, the backward reads them again and writes
16-bit d logits, which the d hidden and d weight products read) and 8·V·D bytes of d weight's
float32 read-modify-write. So a larger budget (more rows per chunk) saves d weight traffic
(8·D / 18·C of the row traffic: a third at the Qwen2.5-0.5B head with 1,200 rows), at the cost
of memory; and the fused kernel reads a row block the second time from L2 if it is still
there, saving 4 of the 18 bytes. Both are counts, not times: this race times them.

What runs: the real launcher, `kernels.linear_loss_grad.linear_loss_grad`, on the rows the
route computes (a quarter of N dropped as padding, as the route drops it), bf16 hidden and
weight of random values (never zeros), dapo with β = 0.04 and old and reference log-probs, all
three products (d hidden and d weight wanted). Each row: the budget and the rows per chunk it
gives, the row kernels, `do_bench`'s median, TFLOP/s counting 6·Na·V·D, the peak memory above
the inputs and the returned gradients (`torch.cuda.max_memory_allocated` after a reset; what
holds it is the [C, V] float32 chunk and d weight's float32 accumulator), and the largest
difference from the default's results (log-probs; d weight relative to its largest entry: a
candidate that computes differently is no candidate). Rows are appended to
`<out>/<device>-three-pass-knobs.csv`. On a CPU (`--device cpu`, Triton's interpreter, torch.mm
in cuBLAS's place) it runs the same calls at a tiny shape: a check of the race, not a
measurement.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from . import HEADS, RESULTS_DIR, device_slug, environment, head_flops
from .measure import time_call
from .step_row import append_row

PAD = 0.25
SCALES = (0.5, 1.0, 2.0)  # the budgets raced: half the default, the default, twice


def default_budgets_mib() -> tuple[float, ...]:
    """The budgets raced by default, in MiB: SCALES × the route's default
    (`kernels.linear_loss_grad.CUDA_BUDGET_BYTES`, read here, never copied)."""
    from grpo_kernels.kernels.linear_loss_grad import CUDA_BUDGET_BYTES

    return tuple(x * CUDA_BUDGET_BYTES / 2**20 for x in SCALES)
COLUMNS = ("device", "date", "commit", "head", "N", "rows", "V", "D", "dtype", "budget_mib",
           "chunk_rows", "row_kernels", "default", "ms", "tflops", "peak_above_mib",
           "max_diff_logp", "max_rel_diff_dweight", "command")


def problem(N: int, D: int, V: int, dtype, device, seed: int = 0):
    """(hidden [Na, D], weight [V, D], ids [Na], the epilogue's inputs [Na] float32, rule) on
    the Na = N - PAD·N rows the route computes."""
    from grpo_kernels.params import GRPOParams

    g = torch.Generator().manual_seed(seed)
    Na = N - int(PAD * N)
    hidden = torch.randn(Na, D, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(device=device, dtype=dtype)
    ids = torch.randint(0, V, (Na,), generator=g).to(device)
    per = lambda x: x.to(device)  # noqa: E731
    inputs = dict(weights=per(torch.full((Na,), 1.0 / Na)),
                  advantages=per(torch.randn(Na, generator=g)),
                  old_logps=per(-5.0 + torch.randn(Na, generator=g)),
                  ref_logps=per(-5.0 + torch.randn(Na, generator=g)),
                  importance_sampling_ratio=None)
    rule = GRPOParams(loss_type="dapo", beta=0.04).token_loss_args
    return hidden, weight, ids, inputs, rule


def one_call(hidden, weight, ids, inputs, rule, budget_mib: float, fused: bool):
    """The launcher's call for one candidate: () -> LossGrad."""
    from grpo_kernels.kernels.epilogue import epilogue_args
    from grpo_kernels.kernels.linear_loss_grad import linear_loss_grad

    ep = epilogue_args(rule, **inputs)
    budget = int(budget_mib * 2**20)
    return lambda: linear_loss_grad(hidden, weight, None, ids, 1.0, ep, needs=(True, True, False),
                                    budget_bytes=budget, fused_rows=fused)


def peak_above(fn, device) -> float | None:
    """MiB allocated at the call's peak beyond what was allocated before it and what it
    returns (its gradients); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    kept = sum(t.numel() * t.element_size() for t in (out.d_hidden, out.d_weight)
               if t is not None)
    return (torch.cuda.max_memory_allocated(device) - base - kept) / 2**20


def race(head: str, N: int, dtype, device, budgets, V=None, D=None) -> Iterator[dict]:
    """One row per (budget, row kernels), each as soon as it is measured (a run cut short
    keeps the rows before); the default (budget and two kernels) first."""
    from grpo_kernels.kernels import linear_loss_grad as llg

    D0, V0 = HEADS[head]
    D, V = D or D0, V or V0
    hidden, weight, ids, inputs, rule = problem(N, D, V, dtype, device)
    Na = hidden.shape[0]
    default_mib = llg.CUDA_BUDGET_BYTES / 2**20
    order = [(default_mib, False)] + [(b, f) for b in budgets for f in (False, True)
                                      if (b, f) != (default_mib, False)]
    expect = None
    for budget_mib, fused in order:
        fn = one_call(hidden, weight, ids, inputs, rule, budget_mib, fused)
        kw = {} if device.type == "cuda" else dict(min_reps=1, max_reps=1)
        ms = time_call(fn, device, **kw).p50
        peak = peak_above(fn, device)
        got = fn()
        logp, dw = got.logp.clone(), got.d_weight.float()
        if expect is None:
            expect = (logp, dw, dw.abs().max().clamp_min(1e-30))
        row = dict(
            head=head, N=N, rows=Na, V=V, D=D, budget_mib=budget_mib,
            chunk_rows=llg.chunk_rows(Na, V, D, int(budget_mib * 2**20)),
            row_kernels="fused" if fused else "two", default=(budget_mib, fused) == order[0],
            ms=round(ms, 3), tflops=round(head_flops(Na, V, D, "fwd+bwd") / ms / 1e9, 1),
            peak_above_mib=None if peak is None else round(peak, 1),
            max_diff_logp=float((logp - expect[0]).abs().max()),
            max_rel_diff_dweight=float((dw - expect[1]).abs().max() / expect[2]))
        del got, logp, dw
        yield row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="llama8b,qwen0.5b",
                        help=f"comma list of {', '.join(HEADS)}")
    parser.add_argument("--tokens", type=int, default=16384, help="N, before the padding drop")
    parser.add_argument("--budgets_mib", default=",".join(f"{b:g}" for b in default_budgets_mib()),
                        help="comma list of chunk budgets in MiB (the default's joins them)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    heads = [h for h in args.heads.split(",") if h]
    unknown = [h for h in heads if h not in HEADS]
    if unknown or not heads:
        parser.error(f"--heads: expected a comma list of {', '.join(HEADS)}, got {args.heads!r}")
    if args.tokens < 4:
        parser.error(f"--tokens must be an integer >= 4, got {args.tokens}")
    try:
        budgets = [float(b) for b in args.budgets_mib.split(",") if b]
    except ValueError:
        budgets = []
    if not budgets or not all(0 < b < float("inf") for b in budgets):
        parser.error(f"--budgets_mib: expected a comma list of MiB > 0, got {args.budgets_mib!r}")
    device = torch.device(args.device)
    small = {}
    if device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu runs the Triton kernels in Triton's interpreter: set "
                         "TRITON_INTERPRET=1 in the environment")
        small = dict(V=300, D=32)  # the interpreter: a tiny head, a check of the race
    env = dict(environment(device), date=datetime.date.today().isoformat())
    command = "python -m benchmarks.three_pass_knobs " + " ".join(argv or sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{device_slug(device)}-three-pass-knobs.csv"
    print("| head | budget MiB | rows/chunk | row kernels | ms | TFLOP/s | peak MiB | "
          "Δ logp | Δ dW (rel) |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for head in heads:
        for r in race(head, args.tokens, torch.bfloat16, device, budgets, **small):
            row = dict(r, device=env["device"], date=env["date"], commit=env["commit"],
                       dtype="bfloat16", command=command)
            append_row(path, {k: row[k] for k in COLUMNS})
            mark = " (default)" if r["default"] else ""
            print(f"| {head} | {r['budget_mib']:g}{mark} | {r['chunk_rows']} | "
                  f"{r['row_kernels']} | {r['ms']:.3f} | {r['tflops']} | {r['peak_above_mib']} |"
                  f" {r['max_diff_logp']:.2e} | {r['max_rel_diff_dweight']:.2e} |", flush=True)
    print(f"rows: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
