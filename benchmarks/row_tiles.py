"""Race of the logits row kernels' launch configurations: which (ROWS, BLOCK_V, num_warps,
num_stages) reads a [N, V] logits buffer fastest, for the default of `kernels.tile_configs.logits`.

    python -m benchmarks.row_tiles --head qwen0.5b --tokens 16384 --out benchmarks/results

Why: the logits-input loss (`grpo_loss`) forward read 5.0 GB in 2.24 ms on an H200, 53 % of the
measured copy rate, where Liger's kernel of the same structure (one program per row, an online
log-sum-exp over V; one warp, 2,048-wide blocks) read its share at ~85 %. The forward reduces
across its block once per column block (max, Σp, Σp·z), so the number of warps that take part
in each reduction is a suspect; the backward has no reduction.

What runs: the real launchers (`logits_logprob_forward` with the GRPO epilogue and padding
skipped, as `grpo_loss` runs it; `logits_logprob_backward` with the skipped rows' step), with
`tile_configs.logits` replaced by each candidate in turn; bf16 logits of random values (never
zeros), dapo with β = 0.04 and old and reference log-probs, PAD of the tokens padding (weight 0).
Each row: the kernel, the configuration (the default marked), `do_bench`'s median, and GB/s
over the bytes the kernel must move (forward: the unmasked rows read once; backward: the rows
with a gradient read and written, the rest written as zeros), and the largest difference of
its results from the default configuration's (a configuration that computes differently is
not a candidate, however fast). Rows are appended to
`<out>/<device>-row-tiles.csv`. On a CPU (`--device cpu`, Triton's interpreter) it runs the same
launches at a tiny shape, a check that the race works, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from . import HEADS, RESULTS_DIR, device_slug, environment
from .measure import time_call
from .step_row import append_row

PAD = 0.25
COLUMNS = ("device", "date", "commit", "kernel", "head", "N", "V", "dtype", "config",
           "default", "ms", "gb_per_s", "max_diff", "command")
# (ROWS, BLOCK_V, num_warps, num_stages or None for Triton's default); the default joins them
FORWARD = ((1, 4096, 4, None), (1, 2048, 4, None), (1, 2048, 2, None), (1, 2048, 1, 2),
           (1, 1024, 1, 2), (1, 8192, 8, None), (1, 4096, 16, None))
BACKWARD = ((1, 4096, 16, 1), (1, 2048, 4, None), (1, 8192, 16, None), (1, 4096, 8, 1))
TINY = ((4, 64, 4, None), (2, 128, 1, 2))  # the interpreter: a check, not a race


def problem(N: int, V: int, dtype, device, seed: int = 0):
    """logits [1, N, V], targets [N], the epilogue's inputs ([N] float32) with PAD padding."""
    from grpo_kernels.params import GRPOParams

    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(1, N, V, generator=g)).to(device=device, dtype=dtype)
    ids = torch.randint(0, V, (N,), generator=g).to(device)
    mask = (torch.rand(N, generator=g) >= PAD).float()
    per = lambda x: x.to(device)  # noqa: E731
    inputs = dict(weights=per(mask / mask.sum()), advantages=per(torch.randn(N, generator=g)),
                  old_logps=per(-5.0 + torch.randn(N, generator=g)),
                  ref_logps=per(-5.0 + torch.randn(N, generator=g)),
                  importance_sampling_ratio=None)
    rule = GRPOParams(loss_type="dapo", beta=0.04).token_loss_args
    return logits, ids, mask, inputs, rule


@contextlib.contextmanager
def tiles(config):
    """`tile_configs.logits` returns `config` (None: itself) inside the block."""
    from grpo_kernels.kernels import tile_configs

    original = tile_configs.logits
    if config is not None:
        rows, block, warps, stages = config
        opts = dict(num_warps=warps, enable_fp_fusion=tile_configs.FP_FUSION)
        if stages is not None:
            opts["num_stages"] = stages
        tile_configs.logits = lambda *a, **k: dict(ROWS=rows, BLOCK_V=block, **opts)
    try:
        yield
    finally:
        tile_configs.logits = original


def calls(logits, ids, inputs, rule):
    """(forward, backward) closures on the real launchers, and a function that returns what
    they wrote (forward: logp, entropy, lse and the epilogue's outputs; backward: d logits)."""
    from grpo_kernels.kernels import logits_logprobs as rows
    from grpo_kernels.kernels.epilogue import epilogue_args

    ep = epilogue_args(rule, **inputs)
    stats = rows.logits_logprob_forward(logits, ids, 0.9, ep, skip_zero_weight=True)
    dx = torch.empty_like(logits)
    coef = ep.outputs[1]

    def forward():
        rows.logits_logprob_forward(logits, ids, 0.9, ep, skip_zero_weight=True, out=stats)

    def backward():
        rows.logits_logprob_backward(logits, ids, stats[2], stats[1], coef, None, 0.9, out=dx,
                                     skipped_rows=True)

    def results(index):
        if index == 0:
            return torch.stack([*stats, *ep.outputs]).nan_to_num(nan=0.0).clone()
        return dx.float().clone()
    return forward, backward, results


def race(N, V, dtype, device, candidates) -> Iterator[dict]:
    """One row per (kernel, configuration), each as soon as it is measured (a run cut short
    keeps the rows before); the default configuration first."""
    from grpo_kernels.kernels import tile_configs

    logits, ids, mask, inputs, rule = problem(N, V, dtype, device)
    kept = int(mask.sum())
    item = logits.element_size()
    moved = dict(forward=kept * V * item, backward=(2 * kept + (N - kept)) * V * item)
    default = tile_configs.logits(V, logits.device)
    for kernel, index in (("forward", 0), ("backward", 1)):
        expect = None
        for config in (None, *candidates[kernel]):
            with tiles(config):
                *fns, results = calls(logits, ids, inputs, rule)
                # the interpreter: a check, not a measurement (one timed call)
                kw = {} if device.type == "cuda" else dict(min_reps=1, max_reps=1)
                ms = time_call(fns[index], device, **kw).p50
                got = results(index)
            expect = got if expect is None else expect  # the default's, first
            cfg = default if config is None else tiles_dict(config)
            yield dict(kernel=kernel, config=describe(cfg), default=config is None,
                       ms=round(ms, 4), gb_per_s=round(moved[kernel] / ms / 1e6, 1),
                       max_diff=float((got - expect).abs().max()))


def tiles_dict(config) -> dict:
    rows, block, warps, stages = config
    return dict(ROWS=rows, BLOCK_V=block, num_warps=warps,
                **({} if stages is None else {"num_stages": stages}))


def describe(cfg: dict) -> str:
    return (f"ROWS={cfg['ROWS']} BLOCK_V={cfg['BLOCK_V']} warps={cfg['num_warps']} "
            f"stages={cfg.get('num_stages', 'default')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default="qwen0.5b", choices=tuple(HEADS))
    parser.add_argument("--tokens", type=int, default=16384, help="N, logits rows")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be a positive integer, got {args.tokens}")
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the Triton kernels in Triton's interpreter: set "
                     "TRITON_INTERPRET=1 in the environment")
    V = HEADS[args.head][1]
    candidates = dict(forward=FORWARD, backward=BACKWARD)
    if device.type != "cuda":  # Triton's interpreter: tiny tiles, a tiny shape
        V = min(V, 300)
        candidates = dict(forward=TINY, backward=TINY[:1])
    env = dict(environment(device), date=datetime.date.today().isoformat())
    command = "python -m benchmarks.row_tiles " + " ".join(argv or sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{device_slug(device)}-row-tiles.csv"
    print("| kernel | configuration | ms | GB/s | max diff |\n|---|---|---|---|---|", flush=True)
    for r in race(args.tokens, V, torch.bfloat16, device, candidates):  # each as measured
        append_row(path, {k: dict(r, device=env["device"], date=env["date"], head=args.head,
                                  commit=env["commit"], N=args.tokens, V=V, dtype="bfloat16",
                                  command=command)[k] for k in COLUMNS})
        mark = " (default)" if r["default"] else ""
        print(f"| {r['kernel']} | {r['config']}{mark} | {r['ms']:.3f} | {r['gb_per_s']} | "
              f"{r['max_diff']:.2e} |", flush=True)
    print(f"rows: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
