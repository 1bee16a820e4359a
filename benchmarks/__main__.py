"""python -m benchmarks: sweep providers × modes × shapes, print a table, append to the CSV.

Examples:
    python -m benchmarks --quick                      # CPU: small shapes of the CPU paths
    python -m benchmarks --heads qwen0.5b,llama8b --tokens 16384 --modes fwd+bwd
    python -m benchmarks --plot bench.png --markdown  # also draw the figure, print Markdown

Rows go to <out>/<device>.csv (one file per device, appended; see runner.COLUMNS); <out> is
results/ under the current directory (created if missing) unless --out says otherwise, so a run
never writes into the directory it is started from, such as the repository root. Flags are
written with underscores (--time_budget); the hyphenated spelling (--time-budget) is accepted
too. A bad argument or input is one line "python -m benchmarks: error: ..." and exit status 2
(--debug: the traceback).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import torch

from grpo_train.flags import MissingPathError, Parser, UsageError, run_cli

from . import HEADS, KERNELS, MODES, STEP_MODES, device_slug, environment, make_shape, show_routes
from . import ceilings as ceilings_mod
from .providers import NAMES, LossConfig, select
from .runner import CsvLog, base_row, new_run_id, read_csv, sweep

# Default sweeps. CUDA: real heads and token counts. CPU: the same code paths on
# shapes a 2-core machine finishes in a few minutes (synthetic heads, labelled as such).
CUDA_FULL = dict(heads="qwen0.5b,qwen7b,llama8b", tokens="4096,16384,65536",
                 modes=",".join(STEP_MODES))
CUDA_QUICK = dict(heads="qwen0.5b,llama8b", tokens="16384", modes="fwd+bwd")
CPU_QUICK = dict(heads="tiny,small", tokens="256,1024", modes=",".join(STEP_MODES))
# Default dtype per device. On CPU the chunked path computes in float32 whatever the input dtype
# (bf16 operands are upcast a tile at a time), while the eager reference given bf16 inputs runs
# bf16 GEMMs and rounds the logits to bf16: a different, less precise computation, so float32 is
# the like-for-like default there. --dtype bfloat16 measures the bf16 case.
DEFAULT_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}


def _csv_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv):
    ap = Parser("python -m benchmarks", description=__doc__)
    ap.add_argument("--kernels", default=",".join(KERNELS), help="fused_linear,logits")
    ap.add_argument("--providers", default=",".join(NAMES), help=",".join(NAMES))
    ap.add_argument("--modes", default=None,
                    help="score,forward,backward,fwd+bwd (score: the forward under "
                         "torch.no_grad, as a scoring call; default: forward,backward,fwd+bwd)")
    ap.add_argument("--heads", default=None, help=",".join(HEADS))
    ap.add_argument("--tokens", default=None, help="N = B·T values, e.g. 4096,16384,65536")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="default: bfloat16 on CUDA, float32 on CPU (where the chunked path "
                         "computes in float32 and the eager reference in bf16 would round its "
                         "logits to bf16)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--quick", action="store_true",
                    help="CUDA: target shapes (N=16384, qwen0.5b+llama8b, fwd+bwd); "
                         "CPU: small shapes (the default there)")
    ap.add_argument("--out", default="results", metavar="DIR",
                    help="results directory, created if missing (default: results/ under the "
                         "current directory; the committed results were written with --out "
                         "benchmarks/results)")
    ap.add_argument("--csv", default=None, help="CSV path (default: <out>/<device>.csv)")
    ap.add_argument("--no_csv", action="store_true", help="print only")
    ap.add_argument("--plot", default=None, help="write the comparison PNG here")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--no_memory", action="store_true", help="skip the peak-memory call")
    ap.add_argument("--no_ceilings", action="store_true",
                    help="reuse the ceilings already in the CSV instead of measuring them")
    ap.add_argument("--time_budget", type=float, default=None,
                    help="seconds; (provider, shape) pairs not started by then are skipped")
    ap.add_argument("--loss_type", default="dapo")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--epsilon", type=float, default=0.2, help="epsilon_low = epsilon_high")
    ap.add_argument("--inplace", action="store_true", help="logits path: grad into the logits")
    ap.add_argument("--backend", default=None, choices=("chunked", "triton"),
                    help="force the backend of ours (fused linear)")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads")
    ap.add_argument("--from_csv", default=None,
                    help="measure nothing: print the table (and --plot) of the latest rows of "
                         "this CSV that match the selection (--kernels/--providers/--modes/...)")
    ap.add_argument("--cpu_budget", type=float, default=2.0,
                    help="CPU: seconds of timed calls per mode for the slowest provider of a "
                         "shape; the providers of a shape are called in turns, 3 to 15 rounds")
    ap.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return ap.parse_args(argv)


def _fmt(x, spec: str) -> str:
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return ""


def table_order(rows: list[dict]) -> list[dict]:
    """Ceilings, then by kernel, head, N, provider (in NAMES order: ours, the peers, the
    reference, the compiled reference), mode."""
    def key(r):
        n = r.get("n_tokens")
        return (r.get("kernel") != "ceiling", r.get("kernel", ""), r.get("head") or "",
                int(n) if n not in (None, "") else 0,
                NAMES.index(r["provider"]) if r.get("provider") in NAMES else -1,
                MODES.index(r["mode"]) if r.get("mode") in MODES else -1)

    return sorted(rows, key=key)


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """Result rows -> aligned text (or Markdown) table; "× ref" = eager reference ms / ms."""
    ref = {(r["kernel"], r["mode"], r["shape"]): float(r["ms_p50"]) for r in rows
           if r.get("provider") == "reference" and r.get("status") == "ok"}
    head = ["kernel", "provider", "mode", "shape", "dtype", "ms p50", "p20-p80", "peak MiB",
            "above in+grad MiB", "TFLOP/s", "GB/s", "% ceiling", "x ref", "status"]
    body = []
    for r in rows:
        ok = r.get("status") == "ok"
        base = ref.get((r.get("kernel"), r.get("mode"), r.get("shape")))
        rated = r.get("tflops") not in (None, "") or r.get("gbps") not in (None, "")
        speed = f"{base / float(r['ms_p50']):.2f}" if ok and base and rated and \
            r["kernel"] != "ceiling" else ""  # no rate: the time is not the mode's whole work
        body.append([
            r.get("kernel", ""), r.get("provider", ""), r.get("mode", ""), r.get("shape", ""),
            r.get("dtype", ""), _fmt(r.get("ms_p50"), ".3f"),
            f"{_fmt(r.get('ms_p20'), '.3f')}-{_fmt(r.get('ms_p80'), '.3f')}" if ok else "",
            _fmt(r.get("peak_mib"), ".1f"), _fmt(r.get("peak_above_mib"), ".1f"),
            _fmt(r.get("tflops"), ".2f"), _fmt(r.get("gbps"), ".1f"),
            _fmt(r.get("pct_ceiling"), ".1f"), speed, r.get("status", ""),
        ])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(c) for c in b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def show_csv(args, heads, tokens, modes) -> int:
    """--from-csv: the latest row per (kernel, provider, mode, shape, dtype) that matches, in
    file order; ceilings (latest of each) first."""
    latest: dict[tuple, dict] = {}
    if not os.path.isfile(args.from_csv):
        raise MissingPathError(f"--from_csv {args.from_csv!r}: no such file")
    for r in read_csv(args.from_csv):
        if r["kernel"] != "ceiling" and not (
            r["kernel"] in _csv_list(args.kernels) and r["provider"] in _csv_list(args.providers)
            and r["mode"] in modes + ["-"] and (heads is None or r["head"] in heads + [""])
            and (tokens is None or r["n_tokens"] in [str(n) for n in tokens] + [""])
        ):
            continue
        key = (r["kernel"], r["provider"], r["mode"], r["shape"], r["dtype"])
        latest.pop(key, None)  # re-insert: a newer row moves to the end
        latest[key] = r
    rows = table_order(list(latest.values()))
    print(format_table(rows, args.markdown))
    info = sorted({(r["device"], r["commit"], r["command"]) for r in rows})
    for device, commit, command in info:
        print(f"\nmeasured on {device}, commit {commit}: {command}")
    if args.plot:
        from .plot import plot

        written = plot(rows, args.plot, "fwd+bwd" if "fwd+bwd" in modes else modes[0])
        print(f"plot: {written}" if written else "plot: no ok rows to draw")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_cli("python -m benchmarks", lambda: _main(argv), argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is available")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = (CUDA_QUICK if args.quick else CUDA_FULL) if device.type == "cuda" else CPU_QUICK
    heads = _csv_list(args.heads or defaults["heads"])
    try:
        tokens = [int(x) for x in _csv_list(args.tokens or defaults["tokens"])]
    except ValueError as err:
        raise UsageError(f"--tokens: expected comma-separated integers, got {args.tokens!r}") \
            from err
    modes = _csv_list(args.modes or defaults["modes"])
    for name, given, allowed in (("head", heads, HEADS), ("mode", modes, MODES),
                                 ("kernel", _csv_list(args.kernels), KERNELS),
                                 ("provider", _csv_list(args.providers), NAMES)):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise UsageError(f"--{name}s: unknown {name}(s) {bad}; choose from {list(allowed)}")
    dtype = getattr(torch, args.dtype or DEFAULT_DTYPE[device.type])
    if args.from_csv:
        return show_csv(args, heads if args.heads else None,
                        tokens if args.tokens else None, modes)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = LossConfig(loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
                     epsilon_high=args.epsilon, inplace=args.inplace, backend=args.backend)
    providers = select(_csv_list(args.kernels), _csv_list(args.providers))
    shapes = [make_shape(h, n) for h in heads for n in tokens]
    env = environment(device)
    command = shlex.join(["python", "-m", "benchmarks", *argv])
    csv_path = Path(args.csv or Path(args.out) / f"{device_slug(device)}.csv")
    log = None if args.no_csv else CsvLog(csv_path)
    run_id = new_run_id()  # shared by this invocation's ceilings and sweep rows
    interp = " (TRITON_INTERPRET=1)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    print(f"# {env['device']}{interp} · torch {env['torch']} · triton {env['triton']}"
          f" · commit {env['commit']}", file=sys.stderr)
    print(f"# loss: {cfg}", file=sys.stderr)
    show_routes()  # one "# ..." line per route the loss calls take

    if args.no_ceilings:  # reuse this device's recorded ceilings, if any ("%" stays empty)
        found = read_csv(csv_path) if csv_path.exists() else []
        ceil, ceil_rows = ceilings_mod.from_rows(found, str(dtype).split(".")[-1]), []
    else:
        ceil, partial = ceilings_mod.measure(device, dtype)
        ceil_rows = [base_row(env, command, run_id, **r) for r in partial]
        for r in ceil_rows:
            if log is not None:
                log.write(r)
    print(f"# ceilings: {ceil}", file=sys.stderr)

    def progress(row):
        print(f"  {row['kernel']:<12} {row['provider']:<17} {row['mode']:<8} "
              f"{row.get('shape', ''):<18} {_fmt(row.get('ms_p50'), '.3f'):>10} ms  "
              f"{row['status']}", file=sys.stderr, flush=True)

    rows = sweep(providers, shapes, modes, dtype, device, cfg, ceil, env, command, log,
                 args.time_budget, progress, memory=not args.no_memory,
                 timing=None if device.type == "cuda" else {"budget_s": args.cpu_budget},
                 run_id=run_id)
    print(format_table(table_order(ceil_rows + rows), args.markdown))
    notes = {p.key: p.note for p in providers if p.note}
    print("\nnotes: " + "; ".join(f"{k}: {v}" for k, v in notes.items()))
    print(f"loss: {cfg.loss_type}, beta={cfg.beta}, eps={args.epsilon}, old/ref logps given, "
          f"~25% padding; device: {env['device']}; commit {env['commit']}; command: {command}")
    if log is not None:
        print(f"appended {len(ceil_rows) + len(rows)} rows to {csv_path}")
    if args.plot:
        from .plot import plot

        source = read_csv(csv_path) if log is not None else rows
        written = plot(source, args.plot, "fwd+bwd" if "fwd+bwd" in modes else modes[0])
        print(f"plot: {written}" if written else "plot: no ok rows to draw")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
