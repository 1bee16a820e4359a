"""Phase boundaries of a training step and an optional recorder of each phase's memory.

grpo_train's trainer marks its phases through the object it is given (`train(cfg, phases=...)`:
`with phases.step():` and `with phases.phase("generation"):`); this module is such an object.
TRL's trainer is marked by callbacks (`begin(name)` / `end(name)`, `begin_step()` / `end_step()`).
Without a recorder installed these are no-ops costing one global read. A benchmark installs a
`PhaseRecorder` with `recording(...)` and gets, per step and per phase:
  start_bytes  memory when the phase began,
  peak_bytes   the highest memory seen while the phase was the innermost one running,
  end_bytes    memory when it ended, and its wall time (less that of phases nested in it),
  rise_bytes   what its own temporaries added: the highest (peak - base) over the stretches
               where it ran as the innermost phase, base = memory when each stretch began.
"Memory" is, on CUDA, the caching allocator's allocated bytes (peak: max_memory_allocated, reset
at every boundary); on CPU, the process' resident set size read from /proc/self/statm, sampled by
a background thread every `interval_s` and at every boundary. PyTorch's large CPU tensors are
mmapped by glibc and unmapped when freed, so the RSS falls back after a phase's temporaries die;
a temporary that lives shorter than the sampling interval can be missed (peaks are lower bounds).

Allocator-independent bytes (CPU, `profile_phases`): the RSS depends on what glibc does with
freed blocks (benchmarks/allocator.py fixes its thresholds), so the phases named there are also
run under torch.profiler with memory events, and their `alloc_rise_bytes` is the highest running
sum of the bytes PyTorch's CPU allocator handed out minus those freed, from the phase's start:
the peak of its live tensors above what was live when it began, whatever the C allocator
underneath keeps resident. Only PyTorch tensors count (not Python objects or library buffers),
and the phase runs slower under the profiler (by how much could not be separated from the
load of a busy 2-core machine: docs/benchmarks.md).

Nesting: a phase opened inside another (TRL's generation inside its scoring) is charged its own
samples; the outer phase resumes afterwards, from the memory the inner one left as its new
base. The step's peak covers everything between `begin_step()` and `end_step()`, phases or not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import threading
import time

import torch

_recorder: PhaseRecorder | None = None  # installed by `recording`; None = hooks do nothing


@contextlib.contextmanager
def phase(name: str):
    """Marks one phase of the step (a no-op unless a recorder is installed)."""
    rec = _recorder
    if rec is None:
        yield
        return
    rec.begin(name)
    try:
        yield
    finally:
        rec.end(name)


@contextlib.contextmanager
def step():
    """Marks one training step: `begin_step()` ... `end_step()`."""
    begin_step()
    try:
        yield
    finally:
        end_step()


def begin(name: str) -> None:
    """`phase` for code that cannot wrap a block (callbacks): begin(name) ... end(name)."""
    if _recorder is not None:
        _recorder.begin(name)


def end(name: str) -> None:
    if _recorder is not None:
        _recorder.end(name)


def begin_step() -> None:
    """A new training step starts (ends the previous one if it was not ended)."""
    if _recorder is not None:
        _recorder.begin_step()


def end_step() -> None:
    if _recorder is not None:
        _recorder.end_step()


@contextlib.contextmanager
def recording(recorder: PhaseRecorder):
    """Installs `recorder` for the hooks above (this process only) and runs its sampler."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a phase recorder is already installed")
    _recorder = recorder
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.stop()
        _recorder = None


def rss_bytes() -> int:
    """The process' current resident set size (Linux /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclasses.dataclass
class PhaseRecord:
    step: int  # 1 = the first step begun while recording
    phase: str  # "step" for the whole step
    start_bytes: int
    peak_bytes: int
    end_bytes: int = 0
    seconds: float = 0.0  # own wall time: nested phases' time excluded
    rise_bytes: int = 0  # see the module docstring
    alloc_rise_bytes: int | None = None  # profiled phases only: see the module docstring
    t0: float = dataclasses.field(default=0.0, repr=False)
    nested_s: float = dataclasses.field(default=0.0, repr=False)
    base_bytes: int = dataclasses.field(default=0, repr=False)  # this stretch's start

    def charge(self, seen: int) -> None:
        self.peak_bytes = max(self.peak_bytes, seen)
        self.rise_bytes = max(self.rise_bytes, seen - self.base_bytes)


class PhaseRecorder:
    """Collects PhaseRecords; see the module docstring for what is measured."""

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.002,
                 limit_bytes: int | None = None, on_limit=None,
                 profile_phases: tuple[str, ...] = ()):
        """`limit_bytes` / `on_limit(recorder, seen_bytes)`: called once, from the sampling
        thread, when the memory first exceeds the limit (CPU: a guard that can stop a run before
        it exhausts a shared machine; the main thread may be inside one long operation).
        `profile_phases`: on CPU, the phases whose allocator bytes torch.profiler counts (one
        profiled phase at a time: a phase named here that opens inside another is not)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if (limit_bytes is None) != (on_limit is None):
            raise ValueError("limit_bytes and on_limit go together")
        self.limit_bytes, self.on_limit, self._tripped = limit_bytes, on_limit, False
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.interval_s = interval_s
        self.records: list[PhaseRecord] = []  # finished phases and steps, in order of ending
        self._stack: list[PhaseRecord] = []
        self._step: PhaseRecord | None = None
        self._steps = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.profile_phases = () if self.cuda else tuple(profile_phases)
        self._profiler = None  # (the PhaseRecord, the running torch.profiler.profile)

    # ---- measuring ---------------------------------------------------------------------------
    def _current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return rss_bytes()

    def _poll(self) -> None:
        """Charges the memory seen since the last poll to the innermost phase and the step."""
        with self._lock:
            if self.cuda:
                seen = torch.cuda.max_memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            else:
                seen = rss_bytes()
            for rec in (self._stack[-1] if self._stack else None, self._step):
                if rec is not None:
                    rec.charge(seen)
            trip = self.limit_bytes is not None and seen > self.limit_bytes and not self._tripped
            self._tripped = self._tripped or trip
        if trip:
            self.on_limit(self, seen)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:  # CUDA's allocator keeps its own peak; CPU needs sampling
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="phase-rss", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        while self._stack:  # an exception left phases open: close them as they are
            self.end(self._stack[-1].phase)
        self.end_step()

    # ---- boundaries ----------------------------------------------------------------------------
    def _open(self, name: str) -> PhaseRecord:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the phase's kernels belong to it
        self._poll()  # what happened so far belongs to the enclosing phase
        now = self._current()
        return PhaseRecord(step=self._steps, phase=name, start_bytes=now, peak_bytes=now,
                           base_bytes=now, t0=time.perf_counter())

    def _close(self, rec: PhaseRecord) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._poll()
        rec.end_bytes = self._current()
        rec.seconds = time.perf_counter() - rec.t0 - rec.nested_s
        self.records.append(rec)

    def begin(self, name: str) -> None:
        rec = self._open(name)
        with self._lock:
            self._stack.append(rec)
        if name in self.profile_phases and self._profiler is None:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          profile_memory=True)
            prof.__enter__()
            self._profiler = (rec, prof)

    def end(self, name: str) -> None:
        if not self._stack or self._stack[-1].phase != name:
            open_ = [r.phase for r in self._stack]
            raise RuntimeError(f"phase {name!r} ended, but the open phases are {open_}")
        rec = self._stack[-1]
        if self._profiler is not None and self._profiler[0] is rec:
            self._profiler[1].__exit__(None, None, None)
            rec.alloc_rise_bytes = allocated_rise(self._profiler[1])
            self._profiler = None
        self._close(rec)
        with self._lock:
            self._stack.pop()
        if self._stack:
            self._stack[-1].nested_s += rec.seconds + rec.nested_s
            self._stack[-1].base_bytes = rec.end_bytes  # the outer phase resumes from here

    def begin_step(self) -> None:
        self.end_step()
        self._steps += 1
        rec = self._open("step")
        with self._lock:
            self._step = rec

    def end_step(self) -> None:
        if self._step is None:
            return
        self._close(self._step)
        with self._lock:
            self._step = None

    # ---- results -------------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """The step running now (1-based; 0 before the first)."""
        return self._steps

    def open_phases(self) -> list[str]:
        """Names of the phases running now, outermost first."""
        return [r.phase for r in self._stack]

    def summary(self, skip_steps: int = 0, include_open: bool = False
                ) -> dict[str, dict[str, float]]:
        """Per phase name (and "step"), over the steps after the first `skip_steps`: the highest
        peak and rise (bytes) and the median of the per-step total seconds. A phase run several
        times in a step (num_iterations > 1) counts with its highest peak and rise.
        `include_open`: phases still running count with what was seen so far."""
        now = time.perf_counter()
        running = [dataclasses.replace(r, seconds=now - r.t0 - r.nested_s)
                   for r in self._stack + ([self._step] if self._step else [])]
        per_step: dict[tuple[int, str], list[PhaseRecord]] = {}
        for rec in self.records + (running if include_open else []):
            if rec.step > skip_steps:
                per_step.setdefault((rec.step, rec.phase), []).append(rec)
        out: dict[str, dict[str, list[float]]] = {}
        for (_, name), recs in per_step.items():
            acc = out.setdefault(name, {"peak_bytes": [], "rise_bytes": [], "seconds": [],
                                        "alloc_rise_bytes": []})
            acc["peak_bytes"].append(max(r.peak_bytes for r in recs))
            acc["rise_bytes"].append(max(r.rise_bytes for r in recs))
            acc["seconds"].append(sum(r.seconds for r in recs))
            acc["alloc_rise_bytes"] += [r.alloc_rise_bytes for r in recs
                                        if r.alloc_rise_bytes is not None]
        return {name: {"peak_bytes": max(v["peak_bytes"]), "rise_bytes": max(v["rise_bytes"]),
                       "seconds": statistics.median(v["seconds"]), "steps": len(v["seconds"]),
                       "alloc_rise_bytes": max(v["alloc_rise_bytes"], default=None)}
                for name, v in out.items()}


def allocated_rise(prof) -> int:
    """The highest running sum of a finished profile's CPU memory events (bytes allocated minus
    bytes freed, in time order): the peak of the tensors allocated while it ran, above what was
    live when it started (a tensor freed before it was allocated inside the window counts
    negative, as it lowers what is live)."""
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak
