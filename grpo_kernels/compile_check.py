"""Ahead-of-time compile of every kernel variant the launchers use, for a CUDA target, on any
machine (no GPU needed: Triton's bundled ptxas does the work).

The Triton interpreter that runs the CPU tests does not enforce what the GPU compiler does
(constexpr globals, branch types, shared-memory limits), so CI compiles each variant for sm_90
and reads ptxas' resource report (registers, spills, shared memory). Run in a process *without*
TRITON_INTERPRET:

    python -m grpo_kernels.compile_check [--arch 90] [--verbose]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

import torch

from . import linear_backward_gemm as gemm
from . import linear_logprobs as lin
from . import logits_logprobs as lgt
from . import tile_configs

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
SCALARS = {"inv_temp", "filter_eps", "eps_low", "eps_high", "delta", "beta", "sapo_pos", "sapo_neg"}
EPILOGUES = [  # (EPILOGUE, LOSS_KIND, HAS_OLD, HAS_DELTA, HAS_KL, BIAS_CORRECT_KL, HAS_ISR)
    (False, 0, False, False, False, False, False),
    (True, 0, True, True, True, True, True),
    (True, 0, False, False, False, False, False),
    (True, 1, True, False, True, False, False),
    (True, 2, True, False, False, False, True),
]
EPI_NAMES = ("EPILOGUE", "LOSS_KIND", "HAS_OLD", "HAS_DELTA", "HAS_KL", "BIAS_CORRECT_KL",
             "HAS_ISR")


def _signature(kernel, constexprs: dict, elem: str) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("h_ptr", "w_ptr", "b_ptr", "x_ptr", "dx_ptr", "dz_ptr"):
            sig[name] = f"*{elem}"
        elif name == "tgt_ptr":
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        else:
            sig[name] = "fp32" if name in SCALARS else "i32"
    return sig


def _compile(kernel, constexprs: dict, elem: str, arch: int, options: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index = {n: i for i, n in enumerate(kernel.arg_names)}
    sig = _signature(kernel, constexprs, elem)
    # what the launcher's specialization sees on real heads: 16-byte aligned tensors, and D and
    # row strides that are multiples of 16 (896, 3584, 4096, 151936 all are)
    aligned = [n for n, t in sig.items() if t.startswith("*") or n == "D" or n.startswith("stride")]
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(index[k],): v for k, v in constexprs.items()},
                    attrs={(index[n],): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes per thread (stack > 0 means spills) from cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    num = lambda key: int(m.group(1)) if (m := re.search(key + r":(\d+)", out)) else -1  # noqa
    return dict(regs=num("REG"), stack=num("STACK"), local=num("LOCAL"))


def variants(quick: bool = False):
    """(name, kernel, constexprs, element type, options) for every launch configuration; `quick`
    keeps bf16 and fp32 with no epilogue and the all-flags epilogue of each loss kind."""
    dev = torch.device("cuda")
    epilogues = [e for e in EPILOGUES if e[2] or not e[0]] if quick else EPILOGUES
    dtypes = {k: v for k, v in DTYPES.items() if not quick or k != torch.float16}
    for dtype, elem in dtypes.items():
        prec = "ieee" if dtype == torch.float32 else "tf32"
        f = tile_configs.linear_fwd(16384, 151936, 896, dtype, dev)
        opts = dict(num_warps=f.pop("num_warps"), num_stages=f.pop("num_stages"))
        for split, bias, epi in itertools.product((False, True), (False, True), epilogues):
            if split and epi[0]:
                continue  # a split forward writes partials; the combine kernel runs the epilogue
            c = dict(zip(EPI_NAMES, epi), HAS_BIAS=bias, SPLIT=split, DOT_PREC=prec, **f)
            yield f"linear_fwd[{elem},split={split},bias={bias},epi={epi[:2]}]", \
                lin._linear_logprob_fwd_kernel, c, elem, opts
        b = tile_configs.linear_bwd_atomic(dtype, dev)
        opts = dict(num_warps=b.pop("num_warps"), num_stages=b.pop("num_stages"))
        for bias, gent, filt in itertools.product((False, True), repeat=3):
            c = dict(HAS_BIAS=bias, HAS_GENT=gent, FILTER=filt, COMPUTE_DH=True,
                     COMPUTE_DW=not gent, COMPUTE_DB=bias, DOT_PREC=prec, **b)
            yield f"linear_bwd[{elem},bias={bias},gent={gent},filter={filt}]", \
                lin._linear_logprob_bwd_kernel, c, elem, opts
        z = tile_configs.linear_dz(dtype, dev)
        opts = dict(num_warps=z.pop("num_warps"), num_stages=z.pop("num_stages"))
        for bias, gent in ((True, True), (False, False)):
            yield f"linear_dz[{elem},bias={bias},gent={gent}]", gemm._linear_dz_kernel, \
                dict(HAS_BIAS=bias, HAS_GENT=gent, DOT_PREC=prec, **z), elem, opts
        for V in (151936,) if quick else (151936, 1000):
            g = tile_configs.logits(V, dev)
            opts = dict(num_warps=g.pop("num_warps"))
            for epi in epilogues:
                yield f"logits_fwd[{elem},V={V},epi={epi[:2]}]", lgt._logits_logprob_fwd_kernel, \
                    dict(zip(EPI_NAMES, epi), **g), elem, opts
            for gent in (False, True):
                yield f"logits_bwd[{elem},V={V},gent={gent}]", lgt._logits_logprob_bwd_kernel, \
                    dict(HAS_GENT=gent, **g), elem, opts
    for epi in epilogues:
        yield f"combine[epi={epi[:2]}]", lin._combine_splits_kernel, \
            dict(zip(EPI_NAMES, epi), BLOCK_N=64, BLOCK_S=16), "fp32", dict(num_warps=4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a representative subset (CI)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check must run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    failures = spilled = 0
    for name, kernel, constexprs, elem, opts in variants(args.quick):
        try:
            compiled = _compile(kernel, constexprs, elem, args.arch, opts)
            rep = _resource_usage(compiled.asm["cubin"])
            spills = rep["stack"] > 0 or rep["local"] > 0
            spilled += spills
            if args.verbose or spills:
                print(f"{'SPILLS' if spills else 'ok':6} {name}: {rep['regs']} regs, "
                      f"{rep['stack']} B stack, {compiled.metadata.shared} B shared")
        except Exception as exc:  # report every broken variant, not just the first
            failures += 1
            print(f"FAILED {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    print(f"compile_check sm_{args.arch}: {failures} failed, {spilled} spill registers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
