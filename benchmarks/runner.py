"""The sweep: shapes × providers × modes -> result rows, appended to a CSV as they are measured.

On CPU the providers of one shape are built together and each mode's calls are timed in turns
(A, B, A, B, ...; `measure.time_cpu_interleaved`): on a shared machine the load of other
processes changes within seconds, and timing one provider after the other would compare them
under different loads. On CUDA each provider is timed on its own (do_bench).

A provider that runs out of memory gives a row with status "OOM" (memory is released and the
sweep goes on); any other failure gives "error: ..." rather than ending the run. Rows are written
one at a time so a run cut short (time limit, crash) keeps what it measured.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from grpo_train.flags import UsageError

from . import MODES, Shape, flops, logits_bytes
from .cases import NotMeasured
from .measure import (
    MiB,
    Timing,
    is_oom,
    memory_cpu,
    memory_cuda,
    release_memory,
    time_call,
    time_cpu_interleaved,
)
from .providers import GRADED, Case, LossConfig, Provider

COLUMNS = [
    "timestamp", "run_id", "kernel", "provider", "mode", "shape", "head", "n_tokens", "batch",
    "seq_len", "hidden", "vocab", "dtype", "status", "ms_p50", "ms_p20", "ms_p80", "reps",
    "peak_mib", "peak_above_mib", "input_mib", "tflops", "gbps", "pct_ceiling", "note",
    "device", "torch", "triton", "commit", "command",
]


class CsvLog:
    """Appends rows to a CSV (header written once; an existing file must have the same one)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open(newline="") as f:
                header = next(csv.reader(f), [])
            if header != COLUMNS:
                raise UsageError(f"--out/--csv: {str(self.path)!r} has other columns than this "
                                 "harness writes; move it aside or pass another --out")
        else:
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(COLUMNS)

    def write(self, row: dict) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, COLUMNS, extrasaction="ignore").writerow(
                {k: _cell(row.get(k)) for k in COLUMNS})


def _cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def read_csv(path: Path | str) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def base_row(env: dict, command: str, run_id: str, **fields) -> dict:
    row = {"timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "run_id": run_id, "command": command, **env}
    row.update(fields)
    return row


def _shape_fields(shape: Shape, dtype: torch.dtype) -> dict:
    return dict(shape=shape.label, head=shape.head, n_tokens=shape.N, batch=shape.B,
                seq_len=shape.T, hidden=shape.D, vocab=shape.V, dtype=str(dtype).split(".")[-1])


def _short(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"error: {type(exc).__name__}: {msg[:160]}"


def _status(exc: BaseException) -> str:
    """The row status of a failed build or call: OOM, n/a (a mode the case does not time) or
    the error."""
    if isinstance(exc, NotMeasured):
        return f"n/a: {exc}"
    return "OOM" if is_oom(exc) else _short(exc)


def _rates(kernel: str, shape: Shape, mode: str, ms: float, elem: int, ceilings: dict,
           rows: int | None = None) -> dict:
    """TFLOP/s for the fused linear loss, GB/s for the logits path (both on `rows` positions,
    default N), and % of the ceiling."""
    sec = ms * 1e-3
    if kernel == "fused_linear":
        tflops = flops(shape, mode, rows) / sec / 1e12
        top = ceilings.get("matmul_tflops")
        return dict(tflops=tflops, pct_ceiling=100.0 * tflops / top if top else None)
    gbps = logits_bytes(shape, mode, elem, rows) / sec / 1e9
    top = ceilings.get("copy_gbps")
    return dict(gbps=gbps, pct_ceiling=100.0 * gbps / top if top else None)


def measure_mode(case: Case, provider: Provider, shape: Shape, mode: str, dtype, device,
                 ceilings: dict, memory: bool = True, timing: dict | None = None) -> dict:
    """Timing (+ one separate call for peak memory) of one mode; raises on failure.
    `timing`: keywords for measure.time_cuda / time_cpu (rep_ms / budget_s, reps)."""
    step = case.step(mode)
    grads = case.leaves if mode in GRADED else []
    t = time_call(step, device, grads, **(timing or {}))
    return _result(case, provider, shape, mode, dtype, device, ceilings, t, step, memory)


def _result(case: Case, provider: Provider, shape: Shape, mode: str, dtype, device,
            ceilings: dict, t: Timing, step, memory: bool) -> dict:
    """The row fields of a timed mode: times, rates and (one separate call) peak memory."""
    grads = case.leaves if mode in GRADED else []
    out = dict(status="ok", ms_p50=t.p50, ms_p20=t.p20, ms_p80=t.p80,
               reps=t.reps if t.reps > 0 else None, input_mib=case.input_bytes / MiB)
    notes = []
    if mode in case.rated_modes:
        out.update(_rates(provider.kernel, shape, mode, t.p50, dtype.itemsize, ceilings,
                          case.positions))
        if case.positions is not None:
            notes.append(f"rate on {case.positions} of {shape.N} positions (unmasked)")
    if memory:
        gbytes = case.grad_bytes if grads else 0
        if device.type == "cuda":
            m = memory_cuda(step, grads, gbytes)
        elif provider.name == "reference-compile" or not case.cpu_memory:
            m = None  # the tracker cannot see allocations inside compiled CPU graphs
        else:
            m = memory_cpu(step, grads, gbytes, case.input_bytes)  # None: not measurable
        if m is not None:
            out.update(peak_mib=m.peak_bytes / MiB, peak_above_mib=m.above_bytes / MiB)
            if m.method == "torch.profiler allocations":  # not the tracker the others use
                notes.append(f"memory: {m.method}")
    route, wrong = case.route_check(mode)
    notes[:0] = [route] if route else []
    if wrong:
        out["status"] = wrong
    if notes:
        out["note"] = "; ".join(notes)
    return out


def run_provider(provider: Provider, shape: Shape, modes: Sequence[str], dtype, device,
                 cfg: LossConfig, ceilings: dict, memory: bool = True,
                 timing: dict | None = None) -> Iterable[dict]:
    """Yields one result dict per mode (status ok / OOM / error)."""
    try:
        case = provider.build(shape, dtype, device, cfg)
    except Exception as exc:  # noqa: BLE001 - recorded in the row, the sweep goes on
        status = _status(exc)
        del exc
        release_memory(device)
        for _ in modes:
            yield dict(status=status, note="while building inputs")
        return
    for mode in modes:
        try:
            res = measure_mode(case, provider, shape, mode, dtype, device, ceilings, memory,
                               timing)
            res["note"] = "; ".join(x for x in (case.note, res.get("note")) if x)
        except Exception as exc:  # noqa: BLE001
            res = dict(status=_status(exc), note=case.note)
            del exc
        for t in case.leaves:
            t.grad = None
        release_memory(device)
        yield res
    del case
    release_memory(device)


def run_group(providers: Sequence[Provider], shape: Shape, modes: Sequence[str], dtype, device,
              cfg: LossConfig, ceilings: dict, memory: bool = True,
              timing: dict | None = None) -> Iterable[tuple[Provider, str, dict]]:
    """CPU: yields (provider, mode, result) for every provider and mode, mode by mode; the
    providers' calls of a mode are timed in turns. A provider that fails (building its inputs,
    or a call) gets its status in its rows; the others go on."""
    cases = {}
    for p in providers:
        try:
            cases[p.key] = p.build(shape, dtype, device, cfg)
        except Exception as exc:  # noqa: BLE001 - recorded in the row, the sweep goes on
            status = _status(exc)
            del exc
            release_memory(device)
            for mode in modes:
                yield p, mode, dict(status=status, note="while building inputs")
    live = [p for p in providers if p.key in cases]
    for mode in modes:
        steps, results = {}, {}
        for p in live:
            try:
                steps[p.key] = cases[p.key].step(mode)  # "backward": runs the forward here
            except Exception as exc:  # noqa: BLE001
                results[p.key] = dict(status=_status(exc))
                del exc
        grads = {k: cases[k].leaves if mode in GRADED else [] for k in steps}
        timed = time_cpu_interleaved({k: (steps[k], grads[k]) for k in steps}, **(timing or {}))
        for p in live:
            case, t = cases[p.key], timed.get(p.key)
            res = results.get(p.key)
            if res is None and isinstance(t, BaseException):
                res = dict(status=_status(t))
            if res is None:
                try:
                    res = _result(case, p, shape, mode, dtype, device, ceilings, t,
                                  steps[p.key], memory)
                except Exception as exc:  # noqa: BLE001
                    res = dict(status=_status(exc))
                    del exc
            res["note"] = "; ".join(x for x in (case.note, res.get("note")) if x)
            for x in case.leaves:
                x.grad = None
            yield p, mode, res
        del steps, timed
        release_memory(device)
    del cases
    release_memory(device)


def sweep(
    providers: Sequence[Provider], shapes: Sequence[Shape], modes: Sequence[str], dtype,
    device: torch.device, cfg: LossConfig, ceilings: dict, env: dict, command: str,
    log: CsvLog | None = None, time_budget_s: float | None = None,
    on_row: Callable[[dict], None] | None = None, memory: bool = True,
    timing: dict | None = None, run_id: str | None = None,
) -> list[dict]:
    """Runs every (shape, provider, mode); returns the rows (also appended to `log`)."""
    run_id = run_id or new_run_id()
    modes = [m for m in MODES if m in modes]
    rows: list[dict] = []
    start = time.monotonic()

    def emit(row: dict) -> None:
        rows.append(row)
        if log is not None:
            log.write(row)
        if on_row is not None:
            on_row(row)

    reported: set[str] = set()
    compiled = [p for p in providers if p.name.endswith("-compile")]
    eager = [p for p in providers if p not in compiled]
    # CPU: the providers of a shape run together (timed in turns); CUDA: one at a time
    together = device.type != "cuda"
    order = [(sh, grp) for group in (eager, compiled) for sh in shapes
             for grp in ([group] if together else [[p] for p in group])]
    for shape, group in order:
        todo = []
        for p in group:
            fields = dict(kernel=p.kernel, provider=p.name)
            reason = p.unavailable(device)
            if reason is not None:
                if p.key not in reported:  # one row per provider and run, not per shape
                    reported.add(p.key)
                    emit(base_row(env, command, run_id, mode="-", shape="-",
                                  dtype=str(dtype).split(".")[-1], status=f"n/a: {reason}",
                                  note=p.note, **fields))
            elif time_budget_s is not None and time.monotonic() - start > time_budget_s:
                emit(base_row(env, command, run_id, mode="-", status="skipped: time budget",
                              **_shape_fields(shape, dtype), **fields))
            else:
                todo.append(p)
        if not todo:
            continue
        if together:
            results = run_group(todo, shape, modes, dtype, device, cfg, ceilings, memory,
                                timing)
        else:
            (p,) = todo
            results = ((p, mode, res) for mode, res in zip(
                modes, run_provider(p, shape, modes, dtype, device, cfg, ceilings, memory,
                                    timing)))
        for p, mode, res in results:
            emit(base_row(env, command, run_id, mode=mode, **_shape_fields(shape, dtype),
                          kernel=p.kernel, provider=p.name, **res))
    return rows
