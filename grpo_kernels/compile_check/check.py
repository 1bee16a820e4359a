"""Ahead-of-time compile of every kernel variant the launchers can launch, for one CUDA
architecture, on any machine (no GPU needed: Triton's bundled ptxas does the work).

The Triton interpreter that runs the CPU tests does not enforce what the GPU compiler does
(constexpr globals, branch types, registers, shared memory), so each variant is compiled here as
the runtime would compile it: tile shapes and options from `tile_configs` (the launchers' own
functions, with an explicit `arch`), and the argument specializations of Triton's JITFunction
for contiguous tensors at realistic shapes (see `specialize`). ptxas' resource report gives
registers, spills and shared memory per variant. Run in a process *without* TRITON_INTERPRET:

    python -m grpo_kernels.compile_check --arch 90 [--quick] [--verbose] [--report] [--jobs J]

The last line is `compile_check sm_N: F failed, S spill registers` (S = spilled 32-bit words
per thread summed over variants). --report prints the static performance report instead of the
per-variant lines (see `static_report`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass, field

from . import all_variants, kernel_variants, perf_model, specialization, static_report


@dataclass
class Result:
    """What one compiled variant costs (measured from the binary)."""
    regs: int = -1
    spill_bytes: int = 0  # per thread, local memory (stack) used by spills
    shared: int = 0  # bytes of shared memory per block
    num_stages: int = 1
    num_warps: int = 4
    sass: dict = field(default_factory=dict)  # see static_report.sass_stats
    error: str = ""


def _ast_source(variant: kernel_variants.Variant):
    """The ASTSource `JITFunction.run` builds for these arguments (Triton 3.4 - 3.9 API)."""
    from triton.compiler import ASTSource

    kernel = variant.kernel
    signature, constexprs, attrs = specialization.signature_of(kernel, variant.args)
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def compile_variant(variant: kernel_variants.Variant, arch: int, want_sass: bool) -> Result:
    """One variant's compile; an OS refusal to start ptxas or cuobjdump (EAGAIN: the machine's
    process or thread limit, under load) is retried, not reported as the variant's failure."""
    for wait in (1.0, 4.0, 16.0, None):
        try:
            return _compile_variant(variant, arch, want_sass)
        except BlockingIOError as exc:
            if wait is None:
                return Result(error=f"BlockingIOError (4 tries): {exc}")
            time.sleep(wait)


def _compile_variant(variant: kernel_variants.Variant, arch: int, want_sass: bool) -> Result:
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        compiled = triton.compile(_ast_source(variant), target=GPUTarget("cuda", arch, 32),
                                  options=dict(variant.options))
        cubin = compiled.asm["cubin"]
        usage = static_report.resource_usage(cubin)
        res = Result(regs=usage["regs"], spill_bytes=max(usage["stack"], usage["local"]),
                     shared=compiled.metadata.shared,
                     num_stages=variant.options.get("num_stages", 3),
                     num_warps=variant.options.get("num_warps", 4))
        limit = perf_model.ARCH[arch]["smem_block"]
        if res.shared > limit:
            res.error = (f"needs {res.shared} B of shared memory per block, sm_{arch} allows "
                         f"{limit} B (it would fail to launch)")
        if want_sass:
            res.sass = static_report.sass_stats(cubin)
        return res
    except BlockingIOError:
        raise  # the OS, not the variant: compile_variant retries
    except Exception as exc:  # report every broken variant, not just the first
        return Result(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                      if str(exc) else type(exc).__name__)


_JOB: tuple = ()  # (variants, arch, want_sass), set before the worker processes fork


def _compile_index(i: int) -> Result:
    variants, arch, want_sass = _JOB
    return compile_variant(variants[i], arch, want_sass)


def compile_all(variants: list, arch: int, want_sass: bool = False, jobs: int = 1) -> list:
    global _JOB
    _JOB = (variants, arch, want_sass)
    if jobs <= 1 or len(variants) < 2:
        return [_compile_index(i) for i in range(len(variants))]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_compile_index, range(len(variants)), chunksize=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_kernels.compile_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90,
                        help="compute capability as an integer: 75, 80, 86, 89, 90, 100, 120")
    parser.add_argument("--verbose", action="store_true", help="one line per variant")
    parser.add_argument("--quick", action="store_true", help="a representative subset (CI)")
    parser.add_argument("--report", action="store_true",
                        help="print the static performance report (Markdown)")
    parser.add_argument("--only", default="",
                        help="compile only variants whose name matches this regular expression")
    parser.add_argument("--default-only", action="store_true",
                        help="compile only the variants the default configuration launches")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compiler processes (default: all CPUs)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check must run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if args.arch not in perf_model.ARCH:
        print(f"--arch must be one of {sorted(perf_model.ARCH)}, got {args.arch}",
              file=sys.stderr)
        return 2
    variants = [v for v in all_variants.variants(args.arch, quick=args.quick)
                if re.search(args.only, v.name) and (v.default or not args.default_only)]
    results = compile_all(variants, args.arch, want_sass=args.report, jobs=args.jobs)
    failures = spilled = 0
    for v, r in zip(variants, results):
        failures += bool(r.error)
        spilled += r.spill_bytes // 4
        if r.error:
            print(f"FAILED {v.name}: {r.error}")
        elif (args.verbose or r.spill_bytes) and not args.report:
            print(f"{'SPILLS' if r.spill_bytes else 'ok':6} {v.name}: {r.regs} regs, "
                  f"{r.spill_bytes} B spilled, {r.shared} B shared")
    if args.report:
        print(static_report.render(args.arch, variants, results, quick=args.quick))
    print(f"compile_check sm_{args.arch}: {failures} failed, {spilled} spill registers")
    return 1 if failures else 0
