"""A model (not a measurement) of forward+backward time of the linear-head loss at the README's
target shapes, built on the compiled binaries' facts (`static_report`).

    time of a kernel >= max(FLOPs / (tensor-core rate × wave efficiency), HBM bytes / bandwidth)
    wave efficiency   = programs / (waves × SMs × blocks per SM), waves rounded up

summed over the default path's kernels: forward (+ combine), then the d-logits kernel and the
two products of the GEMM backward (library GEMMs, and `accumulate_mm` for the product summed
over chunks). Every input is written next to the result; see /work/shared and
STATIC_GPU_EVIDENCE.md for the method.
"""

from __future__ import annotations

import torch
import triton

from ..kernels import linear_backward_gemm as gemm
from ..kernels import tile_configs
from .kernel_variants import SMS, forward_grid

# Per-architecture limits (CUDA programming guide, "compute capabilities" table): registers per
# SM, shared memory per SM and per block (opt-in maximum), threads and blocks per SM.
ARCH = {
    75: dict(regs=65536, smem_sm=64 * 1024, smem_block=64 * 1024, threads=1024, blocks=16),
    80: dict(regs=65536, smem_sm=164 * 1024, smem_block=163 * 1024, threads=2048, blocks=32),
    86: dict(regs=65536, smem_sm=100 * 1024, smem_block=99 * 1024, threads=1536, blocks=16),
    89: dict(regs=65536, smem_sm=100 * 1024, smem_block=99 * 1024, threads=1536, blocks=24),
    90: dict(regs=65536, smem_sm=228 * 1024, smem_block=227 * 1024, threads=2048, blocks=32),
    100: dict(regs=65536, smem_sm=228 * 1024, smem_block=227 * 1024, threads=2048, blocks=32),
    120: dict(regs=65536, smem_sm=100 * 1024, smem_block=99 * 1024, threads=1536, blocks=32),
}
RESERVED_SMEM = 1024  # per block, taken by the system on sm_80 and later


def blocks_per_sm(arch: int, regs: int, warps: int, shared: int) -> int:
    """Resident blocks per SM: registers (allocated per warp in units of 256), threads, shared
    memory (plus the 1 KB the system reserves per block) and the block limit."""
    a = ARCH[arch]
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = a["regs"] // (per_warp * warps)
    by_threads = a["threads"] // (32 * warps)
    by_smem = a["smem_sm"] // (shared + RESERVED_SMEM) if shared else a["blocks"]
    return max(0, min(by_regs, by_threads, by_smem, a["blocks"]))

# (tensor-core bf16 dense rate FLOP/s, HBM bytes/s, SM clock Hz, source) per architecture
MACHINES = {
    90: (790e12, 3.0e12, 1.98e9,
         "H100 SXM 80GB: 132 SMs; 790 TFLOP/s = bf16 8192³ matmul measured on this "
         "workplace's lent H100 (769-798); 3.0 TB/s = low end of its measured device copy "
         "(3.0-4.3 TB/s); 1980 MHz SM clock under load (measured)"),
    80: (312e12, 2.0e12, 1.41e9,
         "A100 SXM 80GB: 108 SMs; 312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e and 1410 MHz boost "
         "clock from NVIDIA's datasheet (not measured here)"),
}
SHAPES = ((16384, 896, 151936), (4096, 896, 151936))  # (N, D, V), bf16
ISSUE_PER_CYCLE = 4  # warp instructions per SM per cycle (4 schedulers)


def _facts(variants, results, kind):
    """The first default bf16 variant of `kind` without bias: (variant, result)."""
    for v, r in zip(variants, results):
        if v.kind == kind and v.default and not r.error and v.name.startswith(kind + "[bf16,") \
                and "bias=True" not in v.name and "gent=True" not in v.name:
            return v, r
    return None, None


def _tiled_kernel(arch, variant, result, tiles, programs, bd_iters, flops, nbytes, note):
    """Model row of a Triton kernel that loops over output tiles [BLOCK_N, BLOCK_V] with a main
    loop over D: per tile, the tensor cores need 2·BN·BV·D / (rate / SMs); the warps issue
    (loop instructions × iterations + tile epilogue instructions) × warps / 4 per cycle. With
    one resident block per SM the epilogue does not overlap the next tile's MMAs."""
    rate, bw, clock, _ = MACHINES[arch]
    sms = SMS[arch]
    if variant is None:
        return (note, flops, nbytes, 1.0, max(flops / rate, nbytes / bw), "no default variant")
    blocks = max(1, blocks_per_sm(arch, result.regs, result.num_warps, result.shared))
    slots = sms * blocks
    eff = programs / (triton.cdiv(programs, slots) * slots)
    t_mma = flops / tiles / (rate / sms)
    warps = result.num_warps
    t_loop = result.sass.get("loop_instrs", 0) * bd_iters * warps / ISSUE_PER_CYCLE / clock
    t_epi = result.sass.get("tile_instrs", 0) * warps / ISSUE_PER_CYCLE / clock
    t_tile = max(t_mma, t_loop + t_epi) if blocks > 1 else max(t_mma, t_loop) + t_epi
    t = max(tiles * t_tile / (sms * eff), nbytes / bw)
    detail = (f"{programs} programs, {blocks} block(s)/SM, per tile: MMA {t_mma * 1e6:.2f} µs, "
              f"issue {t_loop * 1e6:.2f} µs main loop + {t_epi * 1e6:.2f} µs epilogue "
              f"({result.sass.get('tile_instrs', 0)} instr./thread)")
    return (note, flops, nbytes, eff, t, detail)


def model_rows(arch: int, variants, results, N: int, D: int, V: int) -> list:
    """[(step, FLOPs, HBM bytes, wave efficiency, modelled seconds, note)]."""
    rate, bw, _, _ = MACHINES[arch]
    bf16 = torch.bfloat16
    f = tile_configs.linear_fwd(N, V, D, bf16, None, arch=arch)
    n_blocks, n_tiles, S, _ = forward_grid(arch, N, D, V, bf16)
    v, r = _facts(variants, results, "linear_fwd")
    # weight read from HBM once per group of GROUP_N token blocks (grouped order, L2 reuse);
    # hidden read once per vocabulary split
    fwd_bytes = V * D * 2 * triton.cdiv(n_blocks, f["GROUP_N"]) + N * D * 2 * S
    rows = [_tiled_kernel(arch, v, r, n_blocks * n_tiles, n_blocks * S,
                          triton.cdiv(D, f["BLOCK_D"]), 2 * N * V * D, fwd_bytes, "forward")]
    z = tile_configs.linear_dz(bf16, None, arch=arch)
    rows_c, cols_c = gemm.chunk_sizes(N, V, z["BLOCK_N"], z["BLOCK_V"], 2,
                                      gemm.dz_budget_bytes(N, V))
    by_tokens = gemm.pick_orientation(N, V, D, rows_c, cols_c, True, True) == "tokens"
    chunks = triton.cdiv(N, rows_c) if by_tokens else triton.cdiv(V, cols_c)
    progs = triton.cdiv(min(rows_c, N) if by_tokens else N, z["BLOCK_N"]) * \
        triton.cdiv(V if by_tokens else min(cols_c, V), z["BLOCK_V"])
    v, r = _facts(variants, results, "linear_dz")
    dz_bytes = N * V * 2  # d logits written once (bf16), over all chunks
    rows.append(_tiled_kernel(
        arch, v, r, progs * chunks, progs, triton.cdiv(D, z["BLOCK_D"]), 2 * N * V * D,
        dz_bytes + V * D * 2 * triton.cdiv(N, z["BLOCK_N"] * z["GROUP_N"]),
        f"d logits ({chunks} {'token' if by_tokens else 'vocabulary'} chunks)"))
    # the two products: library GEMM / accumulate_mm at the measured matmul rate
    acc = (V if by_tokens else N) * D * 4
    for step, nbytes, note in (
            ("GEMM (complete product)", dz_bytes, "library GEMM at the matmul rate"),
            ("accumulate_mm (summed product)", dz_bytes + 2 * acc * chunks,
             f"at the matmul rate; float32 accumulator {acc / 2**20:.0f} MiB read+written per "
             "chunk")):
        rows.append((step, 2 * N * V * D, nbytes, 1.0,
                     max(2 * N * V * D / rate, nbytes / bw), note))
    return rows


def model_section(arch: int, variants, results) -> list:
    if arch not in MACHINES:
        return [f"No time model for sm_{arch} (only sm_90 and sm_80 have machine figures)."]
    rate, bw, _, source = MACHINES[arch]
    lines = ["## Model estimate of forward+backward time (not a measurement)", "",
             f"Machine assumed: {source}.", "",
             "Assumptions: a kernel takes at least its HBM bytes / bandwidth; a tiled Triton "
             "kernel (forward, d logits) takes, per output tile and SM, the larger of its "
             "tensor-core time at the measured matmul rate and the time to issue its SASS "
             "(instructions per thread of the main loop × iterations, plus the tile loop's "
             "epilogue, × warps, 4 warp instructions per cycle); with one resident block per "
             "SM the epilogue is added to the MMA time instead (no overlap); tiles spread over "
             "the SMs in whole waves (wave efficiency = programs / (waves × SMs × blocks/SM)). "
             "The two gradient products (library GEMM, `accumulate_mm`) run at the matmul "
             "rate. Not modelled: pipeline stalls, L2 misses beyond the grouped order (weight "
             "read once per GROUP_N token blocks), the combine kernel, the per-token epilogue, "
             "launch gaps. bf16, no bias, no entropy gradient, PyTorch defaults; facts from "
             "the default bf16 variants in the table above.", ""]
    for N, D, V in SHAPES:
        rows = model_rows(arch, variants, results, N, D, V)
        total = sum(r[4] for r in rows)
        ideal = 8 * N * V * D / rate
        hbm = (2 * (N * D + V * D) * 2 + (N * D + V * D) * 2) / bw
        lines += [f"### N={N}, D={D}, V={V}, bf16", "",
                  "| step | TFLOP | HBM GB | wave eff. | model ms | note |",
                  "|---|---|---|---|---|---|"]
        for step, flops, nbytes, eff, t, note in rows:
            lines.append(f"| {step} | {flops / 1e12:.2f} | {nbytes / 1e9:.2f} | {eff:.2f} | "
                         f"{t * 1e3:.2f} | {note} |")
        lines += ["", f"Model total {total * 1e3:.1f} ms; roofline 8·N·V·D = "
                  f"{8 * N * V * D / 1e12:.2f} TFLOP at {rate / 1e12:.0f} TFLOP/s = "
                  f"{ideal * 1e3:.1f} ms ({100 * ideal / total:.0f}% of roofline in this "
                  f"model); HBM bound (hidden and weight read in forward and backward, their "
                  f"gradients written once) {hbm * 1e3:.2f} ms.", ""]
    return lines
