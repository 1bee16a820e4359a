"""Hardware ceilings measured in the same run as the kernels (not datasheet numbers).

  matmul: a large square matmul in the benchmark dtype (bf16: 8192³ on CUDA) -> TFLOP/s,
          the rate the fused linear loss (a chain of N·V·D matmuls) is compared with;
  copy:   a large device-to-device copy -> GB/s counting the read and the write,
          the rate the logits path (three passes over N·V logits) is compared with.
CPU runs use smaller sizes (2048³ matmul, 256 MiB copy) so they finish in seconds; the size is
written into the row.
"""

from __future__ import annotations

import torch

from .measure import MiB, is_oom, release_memory, time_call


def _sizes(device: torch.device) -> tuple[int, int]:
    """(matmul edge n, copy bytes per buffer)."""
    if device.type == "cuda":
        return 8192, 2 * 2**30  # 2 GiB buffers: far beyond L2, so DRAM bandwidth is measured
    return 2048, 256 * MiB


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> tuple[float, float]:
    """(TFLOP/s at the median, median ms) of C[n, n] = A[n, n] @ B[n, n]."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = time_call(lambda: torch.matmul(a, b, out=out), device)
    return 2.0 * n**3 / (t.p50 * 1e-3) / 1e12, t.p50


def copy_gbps(device: torch.device, nbytes: int) -> tuple[float, float]:
    """(GB/s at the median, median ms) of dst.copy_(src), counting 2·nbytes moved."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device)
    return 2.0 * nbytes / (t.p50 * 1e-3) / 1e9, t.p50


def measure(device: torch.device, dtype: torch.dtype) -> tuple[dict, list[dict]]:
    """Both ceilings -> ({"matmul_tflops", "copy_gbps"}, partial CSV rows).

    A ceiling that cannot be measured (OOM on a small device) is left out, and the % column of
    the rows that would use it stays empty.
    """
    n, nbytes = _sizes(device)
    ceilings: dict[str, float] = {}
    rows: list[dict] = []
    dname = str(dtype).split(".")[-1]
    try:
        tf, ms = matmul_tflops(device, dtype, n)
        ceilings["matmul_tflops"] = tf
        rows.append(dict(kernel="ceiling", provider="torch.matmul", mode="-",
                         shape=f"{n}x{n}x{n}", dtype=dname, status="ok", ms_p50=ms,
                         tflops=tf, pct_ceiling=100.0, note="2·n³ FLOPs"))
    except Exception as exc:  # noqa: BLE001
        rows.append(dict(kernel="ceiling", provider="torch.matmul", mode="-",
                         shape=f"{n}x{n}x{n}", dtype=dname,
                         status="OOM" if is_oom(exc) else f"error: {exc}"[:160]))
    release_memory(device)
    try:
        gb, ms = copy_gbps(device, nbytes)
        ceilings["copy_gbps"] = gb
        rows.append(dict(kernel="ceiling", provider="tensor.copy_", mode="-",
                         shape=f"{nbytes // MiB} MiB", dtype="float32", status="ok", ms_p50=ms,
                         gbps=gb, pct_ceiling=100.0, note="read + write counted"))
    except Exception as exc:  # noqa: BLE001
        rows.append(dict(kernel="ceiling", provider="tensor.copy_", mode="-",
                         shape=f"{nbytes // MiB} MiB", dtype="float32",
                         status="OOM" if is_oom(exc) else f"error: {exc}"[:160]))
    release_memory(device)
    return ceilings, rows


def from_rows(rows: list[dict], dtype: str) -> dict:
    """Ceilings recorded earlier in a CSV (the latest ok ones; the matmul in `dtype`): lets
    `--no-ceilings` runs still fill the % column from the same device's file."""
    out: dict[str, float] = {}
    for r in rows:
        if r.get("kernel") != "ceiling" or r.get("status") != "ok":
            continue
        if r.get("provider") == "torch.matmul" and r.get("tflops") and r.get("dtype") == dtype:
            out["matmul_tflops"] = float(r["tflops"])
        if r.get("provider") == "tensor.copy_" and r.get("gbps"):
            out["copy_gbps"] = float(r["gbps"])
    return out


def main() -> int:
    """`python -m benchmarks.ceilings [dtype]`: print this machine's two ceilings, nothing else
    (a quick check that a device is healthy before a long sweep)."""
    import sys

    from . import device_label

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    ceilings, rows = measure(device, dtype)
    print(device_label(device))
    for r in rows:
        rate = f"{r['tflops']:.2f} TFLOP/s" if "tflops" in r else (
            f"{r['gbps']:.1f} GB/s" if "gbps" in r else "")
        print(f"  {r['provider']:<13} {r['shape']:<16} {r['dtype']:<9} {r['status']:<4} {rate}")
    return 0 if len(ceilings) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
