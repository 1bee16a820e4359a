"""Fixed glibc malloc thresholds for CPU memory figures.

glibc's mmap threshold adapts: after a block above the threshold is freed, the threshold rises
to that block's size (up to 32 MiB), so later allocations of up to that size come from the heap
and stay resident after they are freed. The resident set size then depends on what ran before
(a warm-up with other lengths leaves more reusable heap behind), not only on what the measured
phase needs: two runs of the same phase can differ by more than a gigabyte.

With both thresholds fixed at 128 KiB, every block above 128 KiB is mmapped and returned to the
system when freed, and the heap is trimmed down to 128 KiB of slack, so a phase's RSS rise is
what its own live tensors add. glibc reads these variables once, when the process starts: a
benchmark entry point re-executes itself with them (`reexec_with_fixed_thresholds`), and says
so in its row (`describe`).
"""

from __future__ import annotations

import os
import sys

THRESHOLD_BYTES = 131072  # 128 KiB: glibc's default mmap threshold before it adapts
FIXED = {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD_BYTES),
         "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD_BYTES)}
_OPT_OUT = "GRPO_BENCH_ADAPTIVE_MALLOC"  # set to 1 to measure with glibc's adaptive defaults


def is_fixed(environ=None) -> bool:
    """Whether this process was started with the fixed thresholds."""
    environ = os.environ if environ is None else environ
    return all(environ.get(k) == v for k, v in FIXED.items())


def describe(environ=None) -> str:
    """The row's `malloc` column: what the process' allocator did with freed blocks."""
    environ = os.environ if environ is None else environ
    if is_fixed(environ):
        return " ".join(f"{k}={v}" for k, v in FIXED.items())
    return "glibc defaults (adaptive mmap threshold)"


def reexec_with_fixed_thresholds() -> None:
    """Replaces this process with the same command line (`sys.orig_argv`) started with the
    fixed thresholds, unless it already runs with them, the platform is not Linux, or
    GRPO_BENCH_ADAPTIVE_MALLOC=1 asks for glibc's defaults. Returns only when no re-execution
    is needed. Call it first thing in a `__main__` block, before any work."""
    if is_fixed() or not sys.platform.startswith("linux") or os.environ.get(_OPT_OUT) == "1":
        return
    env = {**os.environ, **FIXED}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
