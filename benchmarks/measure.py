"""Timing and peak-memory measurement, on CUDA and on CPU.

CUDA: `triton.testing.do_bench` (L2 flushed between calls, CUDA events), quantiles p50/p20/p80;
peak memory from the caching allocator's statistics around ONE separate call (do_bench itself
allocates a cache-flush buffer, so memory is never read during timing).
CPU: `time.perf_counter` around each call, the same quantiles; peak memory from a dispatch-mode
tracker of live tensor storages (an estimate: scratch inside a single aten op is not seen), or,
for a call that runs grpo_kernels' custom operators (whose insides the tracker cannot see, and
whose route a dispatch mode changes), from torch.profiler's allocation events. The
providers of one shape are timed in turns (`time_cpu_interleaved`), so that the load of other
processes on a shared machine, which changes within seconds, falls on all of them alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MiB = 2**20


@dataclass
class Timing:
    p50: float  # milliseconds
    p20: float
    p80: float
    reps: int


def _quantiles(samples_ms: Sequence[float]) -> Timing:
    xs = sorted(samples_ms)
    if len(xs) == 1:
        return Timing(xs[0], xs[0], xs[0], 1)
    q = statistics.quantiles(xs, n=10, method="inclusive")  # deciles: q[1]=p20, q[7]=p80
    return Timing(statistics.median(xs), q[1], q[7], len(xs))


def _reset(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def time_cuda(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = (),
              rep_ms: float = 100.0) -> Timing:
    """do_bench with at least ~5 timed repetitions even for calls slower than rep_ms / 5. The
    call is sized by its second run: the first compiles and autotunes (Triton, torch.compile;
    seconds to a minute), and a rep of five times that would spend the device run's budget on
    repetitions."""
    from triton.testing import do_bench

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # the first: compiles, autotunes, allocates; the second: sized
        _reset(grad_to_none)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    rep = max(rep_ms, 5.0 * start.elapsed_time(end))
    p50, p20, p80 = do_bench(fn, warmup=25, rep=rep, grad_to_none=list(grad_to_none),
                             quantiles=[0.5, 0.2, 0.8])
    return Timing(p50, p20, p80, -1)  # do_bench does not report its repetition count


def time_cpu(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = (),
             min_reps: int = 3, max_reps: int = 15, budget_s: float = 2.0) -> Timing:
    """Median of per-call wall times after one warm-up call; as many calls as fit in budget_s."""
    _reset(grad_to_none)
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    reps = int(min(max_reps, max(min_reps, budget_s // max(first, 1e-6))))
    samples = []
    for _ in range(reps):
        _reset(grad_to_none)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(samples)


def time_cpu_interleaved(calls: dict, min_reps: int = 3, max_reps: int = 15,
                         budget_s: float = 2.0) -> dict:
    """calls: {key: (fn, tensors whose .grad is reset before each call)} -> {key: Timing}, or
    the exception (traceback dropped) for a call that raised; it leaves the turns.

    One warm-up call each, then rounds of one call each (A, B, C, A, B, C, ...): as many rounds
    as fit budget_s for the slowest call (min_reps to max_reps); median per call."""
    out, first = {}, {}

    def call(key):
        fn, grads = calls[key]
        _reset(grads)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def failed(key, exc):
        out[key] = exc.with_traceback(None)  # no frames (and their tensors) kept alive

    for key in calls:
        try:
            first[key] = call(key)
        except Exception as exc:  # noqa: BLE001 - returned to the caller
            failed(key, exc)
    live = [k for k in calls if k in first]
    if not live:
        return out
    slowest = max(first[k] for k in live)
    reps = int(min(max_reps, max(min_reps, budget_s // max(slowest, 1e-6))))
    samples: dict = {k: [] for k in live}
    for _ in range(reps):
        for key in list(live):
            try:
                samples[key].append(call(key) * 1e3)
            except Exception as exc:  # noqa: BLE001
                failed(key, exc)
                live.remove(key)
    for key in live:
        _reset(calls[key][1])
        out[key] = _quantiles(samples[key])
    return out


def time_call(fn, device: torch.device, grad_to_none=(), **kw) -> Timing:
    if device.type == "cuda":
        return time_cuda(fn, grad_to_none, **kw)
    return time_cpu(fn, grad_to_none, **kw)


class LiveStorageTracker(TorchDispatchMode):
    """Tracks bytes of tensor storages created while active and still alive; keeps the maximum.

    An op output whose storage is not one of its inputs' storages is a new allocation; views and
    in-place results share an input's storage and are not counted again. Storages that existed
    before the tracker started (the inputs, a saved graph) are never counted.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.current = 0
        self.peak = 0
        self.opaque = False  # an op whose inner allocations this mode cannot see ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # grpo_kernels' custom operators (torch.library) run their bodies below this mode: their
        # scratch is invisible here, so a peak read around them would be an under-count
        self.opaque |= func.namespace == "grpo_kernels"
        out = func(*args, **(kwargs or {}))
        seen = {
            StorageWeakRef(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for ref in [r for r in self.live if r.expired()]:
            self.current -= self.live.pop(ref)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref in seen or ref in self.live:
                continue
            self.live[ref] = storage.nbytes()
            self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


@dataclass
class Memory:
    peak_bytes: float  # absolute peak during the call (inputs included)
    above_bytes: float  # peak minus what was allocated before the call minus the gradients
    method: str = ""  # how it was counted, when not the device's own statistics


def memory_cuda(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor],
                grad_bytes: int) -> Memory:
    """One call between reset_peak_memory_stats() and max_memory_allocated(); grads are cleared
    first so the call allocates them, and they are then subtracted (they are outputs)."""
    _reset(grad_to_none)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return Memory(float(peak), float(peak - base - grad_bytes))


def memory_cpu(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor],
               grad_bytes: int, input_bytes: int) -> Memory | None:
    """Peak of one call above its inputs. First under the live-storage tracker; when the call ran
    a custom operator the tracker cannot see into (grpo_kernels' own losses), again without any
    dispatch mode (under one, the library takes its operators' route, not the one a user's call
    takes) under torch.profiler, whose allocation events count every CPU allocation, inside
    operators too. `Memory.method` says which; None if neither could count."""
    _reset(grad_to_none)
    gc.collect()
    with LiveStorageTracker() as tracker:
        fn()
    if not tracker.opaque:
        return Memory(float(input_bytes + tracker.peak), float(tracker.peak - grad_bytes),
                      "live tensor storages")
    from .phases import allocated_rise

    _reset(grad_to_none)
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    rise = allocated_rise(prof)
    if rise <= 0:
        return None  # no allocation event seen: this profiler records none
    return Memory(float(input_bytes + rise), float(rise - grad_bytes),
                  "torch.profiler allocations")


def is_oom(exc: BaseException) -> bool:
    """CUDA OOM, or an allocator failure reported as RuntimeError (CPU, some CUDA paths)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in msg or "can't allocate memory" in msg
    )


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
