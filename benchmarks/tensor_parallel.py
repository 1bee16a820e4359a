"""A vocabulary-parallel head's GRPO loss against the gathered logits transformers' tensor
parallelism gives by default, on CPU processes (gloo, one process per rank, one thread each).

    python -m benchmarks.tensor_parallel                                  # tp = 1, 2, 4
    python -m benchmarks.tensor_parallel --tp 2 --tokens 256 --reps 2     # one cell, quickly
    python -m benchmarks.tensor_parallel --out benchmarks/results/tp.csv  # rows to a CSV too

Each tp runs under torchrun. Every rank holds the same hidden states [N, D] and its rows of a
[V, D] float32 head (a DTensor with Shard(0) on a 1-D mesh), and runs the loss's forward and
backward (dapo, gradients into hidden and weight). Providers:

    whole      tp = 1 only: grpo_kernels' fused loss on the whole head, the single-process
               figure the shards are compared to
    fused      grpo_kernels on the DTensor head (grpo_kernels.parallel), on its four-pass and its
               three-pass route (GRPO_KERNELS_THREE_PASS=0 / 1)
    gathered   what transformers' `colwise_gather_output` head does: local logits h @ W_r^T,
               all-gathered into [N, V] on every rank, then grpo_kernels' leanest loss from
               logits (`grpo_loss`); backward: the local slice of d logits, d W local, d hidden
               all-reduced

Per row (rank 0's; every rank computes the same shapes): the median milliseconds of `--reps`
forward + backward calls after one warm-up, each between two barriers (the slowest rank sets
it; tp ranks share the machine's cores); the peak of torch.profiler's CPU memory events over
one call (allocator-independent), above what was live before it (the inputs), with and without
the gradients (d hidden [N, D] and d W [V/tp, D]); the bytes this rank moves per call, counted
from every collective's tensors (ring algorithms: an all-gather receives (tp-1)/tp of its
output, an all-reduce sends and receives 2·(tp-1)/tp of its tensor each way; the column counts
one direction). The three-pass route's chunks are --chunk_rows rows at every tp
(GRPO_KERNELS_CHUNK_MIB is set to that budget), so that its buffers differ only in V / tp.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import cpu_model, git_commit
from benchmarks.phases import allocated_rise
from benchmarks.shared_prompt import append_row
from grpo_train.flags import Parser, run_cli

MiB = 2**20


# ---- the gathered-logits path (transformers' colwise_gather_output) ---------------------------


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (a replicated input of a
    column-parallel linear)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _GatherColumns(torch.autograd.Function):
    """[N, V/tp] local logits -> [N, V] on every rank (all-gather); backward: the local slice."""

    @staticmethod
    def forward(ctx, local):
        tp, (N, Vr) = dist.get_world_size(), local.shape
        out = local.new_empty(tp * N, Vr)
        dist.all_gather_into_tensor(out, local.contiguous())
        ctx.rank, ctx.Vr = dist.get_rank(), Vr
        return out.view(tp, N, Vr).permute(1, 0, 2).reshape(N, tp * Vr)

    @staticmethod
    def backward(ctx, g):
        return g[:, ctx.rank * ctx.Vr:(ctx.rank + 1) * ctx.Vr].contiguous()


def _gathered(hidden, weight, ids, adv, mask):
    from grpo_kernels import grpo_loss

    logits = _GatherColumns.apply(_AllReduceGrad.apply(hidden) @ weight.T)  # [N, V]
    return grpo_loss(logits, ids, adv, mask, cu_seqlens=_cu(ids), loss_type="dapo")[0]


def _cu(ids):
    return torch.tensor([0, ids.shape[0]])  # one packed sequence of N tokens


# ---- one rank ---------------------------------------------------------------------------------


class CountBytes:
    """Bytes this rank moves per collective while active (ring algorithms, one direction)."""

    NAMES = ("all_gather_into_tensor", "all_gather_single", "all_reduce")

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        tp = dist.get_world_size()
        for name, fn in self.saved.items():
            def counted(*args, _fn=fn, _name=name, **kw):
                t = args[0]  # the output (all-gather) or the reduced tensor
                share = 2 * (tp - 1) / tp if _name == "all_reduce" else (tp - 1) / tp
                self.calls.append((_name, int(t.numel() * t.element_size() * share)))
                return _fn(*args, **kw)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.calls)


def _inputs(N: int, D: int, V: int, rank: int, tp: int):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * D ** -0.5  # logits ~ N(0, 1)
    ids = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(1, generator=g)
    return hidden, weight, ids, adv


def chunk_mib(rows: int, V: int, D: int) -> str:
    """GRPO_KERNELS_CHUNK_MIB's text for exactly `rows` rows per chunk of a [V, D] shard
    (`kernels.linear_loss_grad.chunk_rows`; half a row more, so that the MiB text's rounding
    never drops a row)."""
    from grpo_kernels.kernels.linear_loss_grad import row_bytes

    return f"{(rows + 0.5) * row_bytes(V, D) / MiB:.6f}"


def _cell(provider: str, route: str, N: int, D: int, V: int, reps: int, chunk_rows: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from grpo_kernels import fused_linear_grpo_loss

    rank, tp = dist.get_rank(), dist.get_world_size()
    hidden, full, ids, adv = _inputs(N, D, V, rank, tp)
    os.environ["GRPO_KERNELS_THREE_PASS"] = "1" if route == "three-pass" else "0"
    Vr = V // tp
    os.environ["GRPO_KERNELS_CHUNK_MIB"] = chunk_mib(chunk_rows, Vr, D)
    mask = torch.ones(N)
    if provider == "gathered":
        weight = full[rank * Vr:(rank + 1) * Vr].clone().requires_grad_()
        run = lambda: _gathered(h, weight, ids, adv, mask)  # noqa: E731
    else:
        if provider == "whole":
            weight = full.clone().requires_grad_()
        else:
            mesh = init_device_mesh("cpu", (tp,))
            weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        run = lambda: fused_linear_grpo_loss(  # noqa: E731
            h, weight, ids, adv, mask, cu_seqlens=_cu(ids), loss_type="dapo")[0]
    del full
    h = hidden.requires_grad_()

    def step():
        h.grad = weight.grad = None
        run().backward()

    with CountBytes() as comm:  # the warm-up, and the bytes of a call
        step()
    h.grad = weight.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        step()
    rise = allocated_rise(prof)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append((time.perf_counter() - t0) * 1e3)
    grads = (N * D + Vr * D) * 4
    detail = {}
    for name, nbytes in comm.calls:
        detail[name] = detail.get(name, 0) + nbytes
    return dict(tp=tp, provider=provider, route=route, n_tokens=N, hidden=D, vocab=V,
                ms_p50=round(statistics.median(times), 1), ms_min=round(min(times), 1),
                ms_max=round(max(times), 1),
                reps=reps, peak_mib=round(rise / MiB, 1),
                peak_above_grads_mib=round((rise - grads) / MiB, 1),
                weight_mib=round(Vr * D * 4 / MiB, 1), comm_bytes=comm.total,
                comm_detail=" ".join(f"{k}:{v}" for k, v in sorted(detail.items())),
                collectives=len(comm.calls), chunk_rows=chunk_rows)


def worker(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = []
    for N in args.tokens:
        for provider, route in _providers(dist.get_world_size()):
            rows.append(_cell(provider, route, N, args.hidden, args.vocab, args.reps,
                              args.chunk_rows))
    if dist.get_rank() == 0:
        Path(args.worker).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _providers(tp: int):
    whole = [("whole", "four-pass"), ("whole", "three-pass")] if tp == 1 else []
    return whole + [("fused", "four-pass"), ("fused", "three-pass"), ("gathered", "-")]


# ---- the driver ---------------------------------------------------------------------------------


def _run_tp(tp: int, argv) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("TRITON_INTERPRET", None)  # the chunked PyTorch backend (the CPU's)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp),
               "-m", "benchmarks.tensor_parallel", "--worker", str(out), *argv]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"tp = {tp} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = Parser("python -m benchmarks.tensor_parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4],
                        help="tensor-parallel sizes, one torchrun each")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="N")
    parser.add_argument("--hidden", type=int, default=896, help="D (Qwen2.5-0.5B's)")
    parser.add_argument("--vocab", type=int, default=151936, help="V (Qwen2.5's)")
    parser.add_argument("--reps", type=int, default=2, help="timed calls per cell")
    parser.add_argument("--chunk_rows", type=int, default=256,
                        help="the three-pass route's rows per chunk, at every tp")
    parser.add_argument("--out", default=None, help="a CSV file to append the rows to")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if any(args.vocab % tp for tp in args.tp):
        parser.error(f"--vocab {args.vocab} must divide by every --tp")
    command = "python -m benchmarks.tensor_parallel " + " ".join(argv)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"# {machine} | {datetime.date.today()} | commit {git_commit()} | torch "
          f"{torch.__version__}\n# {command}")
    print(f"{'tp':>2} {'N':>5} {'provider':<9} {'route':<10} {'ms':>9} {'peak MiB':>9} "
          f"{'-grads':>8} {'comm bytes':>12} {'load':>15}")
    worker_argv = [a for a in argv if a not in ("--out", args.out)]
    for tp in args.tp:
        rows = _run_tp(tp, worker_argv)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        for r in rows:
            print(f"{r['tp']:>2} {r['n_tokens']:>5} {r['provider']:<9} {r['route']:<10} "
                  f"{r['ms_p50']:>9.1f} {r['peak_mib']:>9.1f} {r['peak_above_grads_mib']:>8.1f} "
                  f"{r['comm_bytes']:>12,} {load:>15}", flush=True)
            if args.out:  # row by row: a run cut short keeps what it measured
                append_row(Path(args.out), dict(
                    date=datetime.date.today().isoformat(), machine=machine,
                    commit=git_commit(), torch=torch.__version__, command=command, **r,
                    load_avg=load))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m benchmarks.tensor_parallel", main))
