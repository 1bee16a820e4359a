"""Static performance report: what each compiled kernel variant costs, read from its binary, and
a labelled model of forward+backward time built on it (`compile_check --report`).

Facts come from the cubin: registers, spills and shared memory from ptxas' resource report
(`cuobjdump --dump-resource-usage`), instruction counts from the SASS (`cuobjdump -sass`), both
tools shipped with Triton. Times are a model (see `model_section`), never a measurement.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

from .perf_model import blocks_per_sm, model_section


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _run_tool(name: str, flags: list, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool(name), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack/local bytes per thread (> 0 means spills) from ptxas' report."""
    out = _run_tool("cuobjdump", ["--dump-resource-usage"], cubin)

    def num(key):
        m = re.search(key + r":(\d+)", out)
        return int(m.group(1)) if m else -1
    return dict(regs=num("REG"), stack=num("STACK"), local=num("LOCAL"))


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_MMA = re.compile(r"^(HGMMA|HMMA|UTCHMMA|UTCQMMA|UTCMMA|IMMA|QMMA|OMMA)\b")
_ATOMIC = re.compile(r"^(ATOM|ATOMG|RED|REDG|REDUX|ATOMS|UTMAREDG)\b")
_BRANCH_TARGET = re.compile(r"(?:0x([0-9a-f]+)|`\(\.L_x_\d+\)\s*)")


def sass_stats(cubin: bytes) -> dict:
    """Instruction mix of a cubin's SASS:
    mma_loop: tensor-core instructions per iteration of the innermost loop that has any, as
              {opcode: count} (the main loop of a tiled dot; empty when there is none);
    mma_total, atomics (global/shared atomic and reduction instructions), spill_ops (LDL/STL);
    loop_instrs: instructions per thread in one iteration of that loop; tile_instrs: those of
    the enclosing loop outside it (per output tile: softmax, masks, stores), or of the whole
    kernel outside it when there is no enclosing loop (one tile per program)."""
    text = _run_tool("cuobjdump", ["-sass"], cubin)
    instrs = [(int(a, 16), op, rest) for a, op, rest in _INSTR.findall(text)]
    mma_total = sum(bool(_MMA.match(op)) for _, op, _ in instrs)
    atomics = sum(bool(_ATOMIC.match(op)) for _, op, _ in instrs)
    spill_ops = sum(op.startswith(("LDL", "STL")) for _, op, _ in instrs)
    # loops: a branch to an earlier address; body = [target, branch]
    loops = []
    for addr, op, rest in instrs:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", rest)
            if m and int(m.group(1), 16) <= addr:
                loops.append((int(m.group(1), 16), addr))
    best: dict = {}
    inner = None
    for lo, hi in loops:
        body = [op for a, op, _ in instrs if lo <= a <= hi and _MMA.match(op)]
        if body and (inner is None or hi - lo < inner[1] - inner[0]):
            inner = (lo, hi)
            best = {}
            for op in body:
                best[op] = best.get(op, 0) + 1
    count = lambda lo, hi: sum(lo <= a <= hi for a, _, _ in instrs)  # noqa: E731
    loop_instrs = tile_instrs = 0
    if inner is not None:
        loop_instrs = count(*inner)
        # the tile loop around the main loop: its other instructions are the per-tile epilogue
        outer = [(lo, hi) for lo, hi in loops if lo <= inner[0] and hi >= inner[1]
                 and (lo, hi) != inner]
        if outer:
            lo, hi = min(outer, key=lambda r: r[1] - r[0])
            tile_instrs = count(lo, hi) - loop_instrs
        else:  # one tile per program: everything outside the main loop, once
            tile_instrs = len(instrs) - loop_instrs
    return dict(mma_loop=best, mma_total=mma_total, atomics=atomics, spill_ops=spill_ops,
                loop_instrs=loop_instrs, tile_instrs=tile_instrs)


def _mma_text(sass: dict) -> str:
    if sass.get("mma_loop"):
        return ", ".join(f"{n}× {op}" for op, n in sorted(sass["mma_loop"].items()))
    total = sass.get("mma_total", 0)
    return f"{total} (outside loops)" if total else "0"


def render(arch: int, variants: list, results: list, quick: bool) -> str:
    import triton

    lines = [f"# Static performance report, sm_{arch}", "",
             f"`python -m grpo_kernels.compile_check --arch {arch} --report"
             f"{' --quick' if quick else ''}` with Triton {triton.__version__} on a CPU "
             "(no GPU): each row is one compiled variant; registers, spills (bytes per thread) "
             "and shared memory (bytes per block) from ptxas' resource report, instruction "
             "counts from the SASS (`cuobjdump -sass`). `tensor-core ops` are per iteration of "
             "the innermost loop that holds them; `atomics` counts ATOM/RED instructions in the "
             "binary. `default` = launched with no opt-in setting (see "
             "`all_variants.variants`).", "",
             "| kernel | default | regs | spills | smem | blocks/SM | stages | tensor-core ops "
             "| atomics |", "|---|---|---|---|---|---|---|---|---|"]
    for v, r in zip(variants, results):
        if r.error:
            lines.append(f"| `{v.name}` | {'yes' if v.default else 'no'} | FAILED: {r.error} "
                         "| | | | | | |")
            continue
        blocks = blocks_per_sm(arch, r.regs, r.num_warps, r.shared)
        lines.append(f"| `{v.name}` | {'yes' if v.default else 'no'} | {r.regs} | "
                     f"{r.spill_bytes} | {r.shared} | {blocks} | {r.num_stages} | "
                     f"{_mma_text(r.sass)} | {r.sass.get('atomics', 0)} |")
    default_rows = [(v, r) for v, r in zip(variants, results) if v.default and not r.error]
    bwd_atomics = sum(r.sass.get("atomics", 0) for v, r in default_rows
                      if v.kind not in ("linear_fwd", "combine", "logits_fwd"))
    spills = sum(r.spill_bytes for _, r in default_rows)
    lines += ["", f"Default variants: {len(default_rows)}; atomics in default backward "
              f"variants: {bwd_atomics}; spilled bytes in default variants: {spills}."]
    lines += ["", *model_section(arch, variants, results)]
    return "\n".join(lines)
