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

from . import linear_backward_gemm as gemm
from . import tile_configs
from .kernel_variants import SMS
from .static_report import blocks_per_sm

# (tensor-core bf16 dense rate FLOP/s, HBM bytes/s, source) per architecture
MACHINES = {
    90: (790e12, 3.0e12, "H100 SXM 80GB: 132 SMs; 790 TFLOP/s = bf16 8192³ matmul measured on "
         "this workplace's lent H100 (769-798); 3.0 TB/s = low end of its measured device copy "
         "(3.0-4.3 TB/s)"),
    80: (312e12, 2.0e12, "A100 SXM 80GB: 108 SMs; 312 TFLOP/s bf16 dense and 2.0 TB/s HBM2e "
         "from NVIDIA's datasheet (not measured here)"),
}
SHAPES = ((16384, 896, 151936), (4096, 896, 151936))  # (N, D, V), bf16


def _facts(arch, variants, results, kind):
    """(blocks per SM, regs) of the first default bf16 variant of `kind` without bias."""
    for v, r in zip(variants, results):
        if v.kind == kind and v.default and not r.error and "bf16" in v.name \
                and "bias=True" not in v.name:
            return blocks_per_sm(arch, r.regs, r.num_warps, r.shared), r
    return None, None


def _wave_eff(programs: int, slots: int) -> float:
    waves = triton.cdiv(programs, slots)
    return programs / (waves * slots)


def model_rows(arch: int, variants, results, N: int, D: int, V: int) -> list:
    """[(step, FLOPs, HBM bytes, wave efficiency, modelled seconds, note)]."""
    rate, bw, _ = MACHINES[arch]
    sms = SMS[arch]
    rows = []
    bf16 = torch.bfloat16
    f = tile_configs.linear_fwd(N, V, D, bf16, None, arch=arch)
    n_blocks, n_tiles = triton.cdiv(N, f["BLOCK_N"]), triton.cdiv(V, f["BLOCK_V"])
    S = tile_configs.num_splits(n_blocks, n_tiles, f["GROUP_N"], None, sms=sms)
    blocks, _ = _facts(arch, variants, results, "linear_fwd")
    eff = _wave_eff(n_blocks * S, sms * max(blocks or 1, 1))
    # weight read from HBM once per group of GROUP_N token blocks (grouped order, L2 reuse);
    # hidden read once per vocabulary split
    fwd_bytes = V * D * 2 * triton.cdiv(n_blocks, f["GROUP_N"]) + N * D * 2 * S
    rows.append(("forward", 2 * N * V * D, fwd_bytes, eff,
                 f"{n_blocks}×{S} programs, {blocks} blocks/SM"))
    z = tile_configs.linear_dz(bf16, None, arch=arch)
    rows_c, cols_c = gemm.chunk_sizes(N, V, z["BLOCK_N"], z["BLOCK_V"], 2,
                                      gemm.dz_budget_bytes(N, V))
    by_tokens = gemm.pick_orientation(N, V, D, rows_c, cols_c, True, True) == "tokens"
    chunks = triton.cdiv(N, rows_c) if by_tokens else triton.cdiv(V, cols_c)
    progs = triton.cdiv(min(rows_c, N) if by_tokens else N, z["BLOCK_N"]) * \
        triton.cdiv(V if by_tokens else min(cols_c, V), z["BLOCK_V"])
    blocks, _ = _facts(arch, variants, results, "linear_dz")
    eff = _wave_eff(progs, sms * max(blocks or 1, 1))
    dz_bytes = N * V * 2  # d logits written once (bf16), over all chunks
    rows.append(("d logits (recompute)", 2 * N * V * D,
                 dz_bytes + V * D * 2 * triton.cdiv(N, z["BLOCK_N"] * z["GROUP_N"]), eff,
                 f"{chunks} {'token' if by_tokens else 'vocabulary'} chunks of {progs} programs"
                 f", {blocks} blocks/SM"))
    # the complete product: one library GEMM per chunk at the measured GEMM rate
    rows.append(("GEMM (complete product)", 2 * N * V * D, dz_bytes, 1.0,
                 "library GEMM at the matmul rate"))
    acc = (V if by_tokens else N) * D * 4
    rows.append(("accumulate_mm (summed product)", 2 * N * V * D, dz_bytes + 2 * acc * chunks,
                 1.0, f"float32 accumulator {acc / 2**20:.0f} MiB read+written per chunk"))
    out = []
    for step, flops, nbytes, eff, note in rows:
        t = max(flops / (rate * eff), nbytes / bw)
        out.append((step, flops, nbytes, eff, t, note))
    return out


def model_section(arch: int, variants, results) -> list:
    if arch not in MACHINES:
        return [f"No time model for sm_{arch} (only sm_90 and sm_80 have machine figures)."]
    rate, bw, source = MACHINES[arch]
    lines = ["## Model estimate of forward+backward time (not a measurement)", "",
             f"Machine assumed: {source}.", "",
             "Assumptions: each kernel takes max(FLOPs / (rate × wave efficiency), HBM bytes / "
             "bandwidth); Triton kernels reach the library GEMM rate inside a full wave (an "
             "optimistic bound: epilogue, softmax and pipeline stalls are not modelled); wave "
             "efficiency from the programs, the SM count and the blocks/SM of the default "
             "bf16 variant above; weight tiles are reused from L2 within a group of GROUP_N "
             "token blocks; the combine kernel and the per-token epilogue are neglected; "
             "bf16 inputs, no bias, no entropy gradient, PyTorch defaults.", ""]
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
