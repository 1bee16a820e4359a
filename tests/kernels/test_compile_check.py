"""The Triton interpreter that runs the CPU tests accepts code the GPU compiler rejects, so every
kernel variant the launchers can launch is also compiled for sm_80 and sm_90 here (no GPU
needed), with the runtime's argument specializations, and the static report is checked."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

from grpo_kernels.compile_check import specialization as sp  # noqa: E402
from grpo_kernels.compile_check import static_report  # noqa: E402


def _compile_check(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "grpo_kernels.compile_check", *args],
                         capture_output=True, text=True, env=env, timeout=1500)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    return out


def test_every_variant_compiles_for_sm80_without_spills():
    last = _compile_check("--arch", "80", "--quick").strip().splitlines()[-1]
    assert last == "compile_check sm_80: 0 failed, 0 spill registers", last


def test_sm90_report_has_its_columns_and_no_default_spills():
    out = _compile_check("--arch", "90", "--quick", "--report")
    lines = out.strip().splitlines()
    assert lines[-1] == "compile_check sm_90: 0 failed, 0 spill registers", lines[-1]
    header = next(ln for ln in lines if ln.startswith("| kernel |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    for col in ("kernel", "default", "regs", "spills", "smem", "blocks/SM", "stages",
                "tensor-core ops", "atomics"):
        assert col in cols, cols
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines
            if ln.startswith("| `")]
    by = {name: dict(zip(cols, r)) for r in rows for name in [r[0].strip("`")]}
    assert len(by) == len(rows)  # one row per variant, names unique
    kinds = {n.split("[")[0] for n in by}
    assert kinds >= {"linear_fwd", "combine", "linear_bwd", "linear_dz", "accumulate_mm",
                     "logits_fwd", "logits_bwd"}, kinds
    # positive control: the atomic backward does use atomics, and the counter sees them
    atomic = [r for n, r in by.items() if n.startswith("linear_bwd")]
    assert atomic and all(int(r["atomics"]) > 0 for r in atomic)
    # the forward's main loop runs on Hopper tensor cores
    fwd = [r for n, r in by.items() if n.startswith("linear_fwd[bf16")]
    assert fwd and all("HGMMA" in r["tensor-core ops"] for r in fwd)
    for n, r in by.items():
        if r["default"] == "yes":
            assert int(r["spills"]) == 0, n
    assert "Model estimate" in out and "roofline" in out


def test_specialization_matches_triton():
    """specialization.specialize mirrors the runtime's own specialization function, tuples
    (the GRPO epilogue's bundle) included."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        def triton_spec(value, spec, align):
            return native_specialize_impl(CUDABackend, value, False, spec, align)
    except ImportError:  # Triton 3.4: the Python implementation
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import create_specialize_impl

        impl = create_specialize_impl(CUDABackend.get_arg_specialization)

        def triton_spec(value, spec, align):
            return impl(value, False, spec, align)
    import torch

    base = torch.empty(64, dtype=torch.bfloat16)
    for value, ptr in [(1, 1), (16, 16), (151936, 151936), (32001, 32001), (0, 0), (-16, -16),
                       (2**31 + 16, 2**31 + 16), (0.5, 0.5), (True, True),
                       (base, sp.Ptr("bf16")), (base[1:], sp.Ptr("bf16", 2)),
                       (base[8:], sp.Ptr("bf16", 16)),
                       ((base, base[1:], 0.5), (sp.Ptr("bf16"), sp.Ptr("bf16", 2), 0.5))]:
        for spec in (True, False):
            for align in (True, False):
                want = tuple(triton_spec(value, spec, align))
                got = sp.specialize(ptr, spec, align)
                assert got == want, (value, spec, align, got, want)


def test_blocks_per_sm():
    # 128 registers × 256 threads = half the 64K register file: two blocks on any arch
    assert static_report.blocks_per_sm(90, 128, 8, 0) == 2
    # shared memory limits sm_86 (100 KB per SM) to one 64 KB block
    assert static_report.blocks_per_sm(86, 32, 4, 64 * 1024) == 1
    # 255 registers with 8 warps: 256 × 32 × 8 = 65536, exactly one block
    assert static_report.blocks_per_sm(80, 255, 8, 1024) == 1


def test_an_os_refusal_to_start_the_compiler_is_retried(monkeypatch):
    """EAGAIN from starting ptxas (a loaded machine's process limit) is the OS, not the variant:
    retried, and reported as a failure only when it persists."""
    from grpo_kernels.compile_check import check

    calls = []

    def flaky(variant, arch, want_sass):
        calls.append(arch)
        if len(calls) < 3:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return check.Result(regs=32)

    monkeypatch.setattr(check, "_compile_variant", flaky)
    monkeypatch.setattr(check.time, "sleep", lambda s: None)
    assert check.compile_variant(None, 90, False).regs == 32 and len(calls) == 3

    def always(variant, arch, want_sass):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(check, "_compile_variant", always)
    assert "BlockingIOError" in check.compile_variant(None, 90, False).error
