"""Tile shapes and launch options of every Triton kernel, in one place, per GPU generation.

The launchers ask here for their meta-parameters (the returned dicts are passed as launch
keyword arguments); `compile_check` asks the same functions with an explicit `arch`, so the
variants it compiles are the ones that launch. CPU tensors (the Triton interpreter) get small
tiles so that tests cover several tiles per dimension quickly.

Every dict sets `enable_fp_fusion` explicitly: Triton 3.9 fuses a*b+c into FMA by default and
warns that 3.10 will stop doing so; pinning it keeps results the same across Triton releases.

Architectures are compute capabilities as integers (75 = T4, 80 = A100, 86 = RTX 30xx/A10/A40,
89 = L4/L40/RTX 40xx, 90 = H100/H200, 100 = B200, 120 = RTX 50xx). The shapes below were chosen
from `python -m grpo_kernels.compile_check --arch N --verbose` (registers, spills, shared memory
per variant; no GPU needed).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP_FUSION = True  # a*b+c as one FMA (Triton's default up to 3.9), pinned

# Most dynamic shared memory one block may use (bytes), per compute capability; a variant over
# it compiles but fails to launch ("out of resource: shared memory"), so compile_check checks it.
SHARED_MEMORY_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024,
                       89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 103: 227 * 1024,
                       120: 99 * 1024, 121: 99 * 1024}


@functools.cache
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def target_arch(device: torch.device | None, arch: int | None = None) -> int | None:
    """The compute capability the tiles are for: `arch` when given (compile_check), the device's
    own at run time, None for the interpreter and CPU tensors (small tiles)."""
    if arch is not None:
        return int(arch)
    if INTERPRET or device is None or device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


# ptxas caps registers for occupancy when no limit is given on SMs with 1536 threads (sm_86,
# sm_89, sm_120: 64-128 registers and 8-48 B of spills in the logits backward and the fp32/mixed
# forward, compile_check) and on sm_100 (the forward at 128 registers + 24 B); an explicit
# .maxnreg of 255 lets it use what 8 warps can have.
UNCAPPED_REGISTERS = {86, 89, 100, 103, 120, 121}


def _opts(num_warps: int, num_stages: int | None = None, cc: int | None = None) -> dict:
    opts = dict(num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    if num_stages is not None:
        opts["num_stages"] = num_stages
    if cc in UNCAPPED_REGISTERS:
        opts["maxnreg"] = 255
    return opts


def _small_matmul_tiles(group_n: int) -> dict:
    return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=32, GROUP_N=group_n, **_opts(4, 1))


def linear_fwd(N: int, V: int, D: int, dtype: torch.dtype, device: torch.device | None,
               arch: int | None = None) -> dict:
    """Forward of the linear-head log-prob (`linear_logprobs._linear_logprob_fwd_kernel`)."""
    cc = target_arch(device, arch)
    if cc is None:
        return _small_matmul_tiles(2)
    # the largest tiles whose online-softmax temporaries stay in registers without spilling
    if dtype == torch.float32:
        if cc < 80:  # sm_75: no TF32 tensor cores, the dot is FMA; 64 KB smem (BLOCK_D=16
            # spilled 8 B there, 32 does not)
            return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, GROUP_N=16, **_opts(8, 2, cc))
        if cc == 90 or cc >= 100:
            return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, GROUP_N=16, **_opts(8, 3, cc))
        # sm_80/86/89 (mma.sync): 64x64 fp32 tiles spill 9 registers at BLOCK_D=32
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=16, GROUP_N=16, **_opts(8, 3, cc))
    if cc < 80:  # sm_75 has no bf16 mma (Triton emits FMA for bf16; fp16 uses mma.sync)
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, GROUP_N=16, **_opts(8, 2, cc))
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=32, GROUP_N=16, **_opts(8, 3, cc))


def num_splits(n_blocks: int, n_tiles: int, group_n: int, device: torch.device | None,
               sms: int | None = None) -> int:
    """Vocabulary splits: enough that GROUP_N token blocks × splits fill the GPU (the grouped
    order of the forward), and more for small N so that there are two programs per SM.
    `sms` (streaming multiprocessors) defaults to the device's own."""
    if sms is None:
        if target_arch(device) is None:
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(triton.cdiv(sms, group_n), triton.cdiv(2 * sms, n_blocks))
    hi = split_cap(n_tiles)
    # waves of 2 programs per SM: whole ones are whole for 1 block per SM too (the 16-bit
    # no-epilogue forward fits 2 blocks on sm_90; epilogue and fp32 variants fit 1)
    return whole_wave_splits(n_blocks, n_tiles, min(want, hi), hi, 2 * sms)


def whole_wave_splits(n_blocks: int, n_tiles: int, lo: int, hi: int, slots: int) -> int:
    """The split count in [lo, hi] whose n_blocks × S programs fill the last wave of `slots`
    concurrent programs best. Among counts within 5% of the best wave efficiency the smallest
    wins: fewer splits mean less [S, N] partial traffic and a cheaper combine. S is taken as the
    launcher realizes it (no empty split: S = cdiv(n_tiles, cdiv(n_tiles, S)))."""
    def realized(S: int) -> int:
        return triton.cdiv(n_tiles, triton.cdiv(n_tiles, S))

    def efficiency(S: int) -> float:
        programs = n_blocks * S
        return programs / (triton.cdiv(programs, slots) * slots)

    options = sorted({realized(S) for S in range(lo, hi + 1)})
    best = max(efficiency(S) for S in options)
    return next(S for S in options if efficiency(S) >= best - 0.05)


MAX_SPLITS = 64  # the combine kernel reads all splits of a token in one [BLOCK_N, BLOCK_S] tile


def split_cap(n_tiles: int) -> int:
    """The most vocabulary splits `num_splits` gives at n_tiles vocabulary tiles, whatever N."""
    return max(1, min(n_tiles // 4, MAX_SPLITS))


def combine(max_splits: int, device: torch.device | None, arch: int | None = None) -> dict:
    """The split-combine kernel (`linear_logprobs._combine_splits_kernel`) for up to
    `max_splits` splits. The launcher gives the vocabulary's `split_cap`, not this launch's S:
    S changes with N, and a BLOCK_S that followed it would compile a new kernel whenever a
    batch's size moved S across a power of two. BLOCK_N keeps the [BLOCK_N, BLOCK_S] tile at
    1,024 values (the combine reads 3·S·N floats once: a small part of the forward's time)."""
    cc = target_arch(device, arch)
    block_s = triton.next_power_of_2(max_splits)
    return dict(BLOCK_N=min(64, max(16, 1024 // block_s)), BLOCK_S=block_s,
                **_opts(4, None, cc))


def linear_bwd_atomic(dtype: torch.dtype, device: torch.device | None,
                      arch: int | None = None, weight_dtype: torch.dtype | None = None) -> dict:
    """Atomic backward (`linear_backward_atomic._linear_logprob_bwd_kernel`); `dtype` is the hidden
    states', `weight_dtype` the head's when it differs (a float32 head under 16-bit hidden)."""
    cc = target_arch(device, arch)
    if cc is None:
        return _small_matmul_tiles(4)
    opts = _opts(8, 2, cc)
    if 80 <= cc < 90:
        # sm_80/86/89: left to itself ptxas capped the variants without d hidden at 128
        # registers (two blocks per SM) and spilled 8 B with bias + entropy gradient (16-bit)
        # or bias (fp32, tf32x3); the variant with both gradients already takes 160, one block
        opts["maxnreg"] = 255
    # the dz tile and two dot results are live at once; a float32 weight under 16-bit hidden
    # (the mixed head) doubles the weight tile and the split dots' operands: at the 16-bit
    # tiles it spilled 120-136 B at 255 registers on sm_80 (96 KB of shared memory, near the
    # 99 KB of sm_86/89/120). sm_90 compiled it spill-free at 190 registers (full set), so it
    # keeps the larger tiles there: 3/4 of the atomic adds per FLOP of the 64x64 tiles
    if dtype == torch.float32 or (weight_dtype == torch.float32 and cc != 90):
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=16, GROUP_N=8, **opts)
    if cc < 80:  # sm_75 (bf16 dots on FMA): BLOCK_D=32 spilled ~300 B at 255 registers
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=16, GROUP_N=8, **opts)
    return dict(BLOCK_N=128, BLOCK_V=64, BLOCK_D=32, GROUP_N=8, **opts)


def linear_dz(dtype: torch.dtype, device: torch.device | None, arch: int | None = None,
              entropy_grad: bool = False, softcap: bool = False) -> dict:
    """d-logits kernel of the GEMM backward (`linear_backward_gemm._linear_dz_kernel`);
    entropy_grad: the entropy's gradient is part of d logits (more live temporaries);
    softcap: the logit soft cap's tanh and its derivative are too (kernels/logit_transform.py)."""
    cc = target_arch(device, arch)
    if cc is None:
        return _small_matmul_tiles(4)
    if dtype == torch.float32 or cc < 80:
        stages = 3 if cc >= 80 else 2
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, GROUP_N=8, **_opts(8, stages, cc))
    # sm_100: 128 x 128 with the entropy gradient spilled 32 B at 255 registers; sm_90: 8 B
    # (fp16, bias, entropy gradient, V not divisible by 16; the full compile_check set); with
    # a soft cap and the entropy gradient, sm_80 spilled 8-16 B (by tokens, d hidden only); a
    # soft cap alone, 8 B on sm_86/89 (bf16, by vocabulary) once padding's rows were masked
    if cc >= 100 or (cc >= 90 and entropy_grad) or (softcap and (entropy_grad or cc in (86, 89))):
        return dict(BLOCK_N=128, BLOCK_V=64, BLOCK_D=32, GROUP_N=8, **_opts(8, 3, cc))
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=32, GROUP_N=8, **_opts(8, 3, cc))


def accumulate_mm(dtype: torch.dtype, device: torch.device | None,
                  arch: int | None = None) -> dict:
    """acc [M, D] float32 += A @ B with 16-bit A, B (`accumulate_mm._accumulate_mm_kernel`)."""
    cc = target_arch(device, arch)
    if cc is None:  # the interpreter: several tiles per dimension in small tests
        return dict(BLOCK_M=16, BLOCK_D=16, BLOCK_K=16, GROUP_M=4, **_opts(4, 1))
    if cc < 80:  # sm_75: bf16 dots run on FMA; 128 x 128 spilled 4 KB, 64 x 64 x 16 none
        return dict(BLOCK_M=64, BLOCK_D=64, BLOCK_K=16, GROUP_M=8, **_opts(8, 2, cc))
    # a plain 16-bit GEMM tile: 128 x 128 float32 accumulator in registers with 8 warps, K in
    # steps of 64, 3 pipeline stages of 32 KB
    return dict(BLOCK_M=128, BLOCK_D=128, BLOCK_K=64, GROUP_M=8, **_opts(8, 3, cc))


def logits(V: int, device: torch.device | None, arch: int | None = None,
           softcap_backward: bool = False, converting_backward: bool = False,
           fused: bool = False) -> dict:
    """Logits-input kernels (`logits_logprobs`); softcap_backward: the backward kernel with a
    logit soft cap (its tanh and derivative add live temporaries); converting_backward: the
    backward writes d logits in another dtype than the logits' (float32 logits, 16-bit d logits:
    the three-pass route, `linear_loss_grad.py`); fused: the forward, epilogue and backward in
    one kernel (`logits_loss_grad.logits_loss_grad`)."""
    cc = target_arch(device, arch)
    if cc is None:
        return dict(ROWS=4, BLOCK_V=64, **_opts(4))
    # one row per program streams V in chunks of 4096 (16 elements, 2-4 16-byte loads per
    # thread); small V packs rows together. 8192-wide chunks spill on sm_80 when V is not a
    # multiple of 16 (the loads cannot be vectorized: 128 registers + 8 B of stack). The soft-
    # capped backward with the entropy gradient spilled 8 B at 4096 (sm_80, float32, V = 32001):
    # it takes 2048-wide chunks (8 elements per thread).
    # Float32 logits in and 16-bit d logits out with V not a multiple of 16 (scalar loads and
    # conversions) spilled 8-16 B at 4096 with the entropy gradient (sm_75, sm_90), and so did
    # the fused kernel (sm_80, float32, a logit scale, 24 B): 2048 for them too.
    narrow = softcap_backward or ((converting_backward or fused) and V % 16 != 0)
    chunk = 2048 if narrow else 4096
    block = min(triton.next_power_of_2(V), chunk)
    rows = max(1, min(16, chunk // triton.next_power_of_2(V)))
    opts = _opts(8 if rows * block >= chunk else 4, None, cc)
    if fused and narrow and cc == 80:
        # the fused kernel keeps m and log s of its rows across its second sweep: ptxas capped
        # it at 48 registers (5 blocks of 8 warps per SM) and spilled 8 B (float32, V = 32,001,
        # no entropy gradient); at most 64 it spills nothing, 4 blocks per SM as with the lse
        # alone (57-64 registers). Uncapped, 78-95 with the entropy gradient: 2-3 blocks.
        opts["maxnreg"] = 64
    return dict(ROWS=rows, BLOCK_V=block, **opts)
