"""benchmarks/chunk_rows.py at a tiny head: each rows value runs in its own process and takes
the route it asks for (0: the four-pass route; R: three passes in chunks of R rows; default)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_each_rows_value_takes_its_route():
    out = subprocess.run([sys.executable, "-m", "benchmarks.chunk_rows", "--shapes", "tiny:64",
                          "--rows", "0,16,default", "--rounds", "1", "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["rows"]: r for r in map(json.loads, (ln for ln in out.stdout.splitlines()
                                                   if ln.startswith("{")))}
    assert set(rows) == {"0", "16", "default"}
    assert any("four-pass" in ln and "GRPO_KERNELS_THREE_PASS=0" in ln for ln in rows["0"]["route"])
    for r in ("16", "default"):
        assert any("three-pass" in ln for ln in rows[r]["route"]), rows[r]["route"]
        assert rows[r]["wall_s"] > 0 and rows[r]["tokens"] > 0
    assert "tiny N=64 rows 16:" in out.stdout and "CPU / four-pass" in out.stdout


@pytest.mark.parametrize("head", ["qwen0.5b", "llama1b"])
@pytest.mark.parametrize("dtype, frozen", [(torch.float32, False), (torch.bfloat16, False),
                                           (torch.bfloat16, True)])
def test_each_rows_value_gets_a_budget_of_exactly_that_many_rows(monkeypatch, head, dtype,
                                                                 frozen):
    """The GRPO_KERNELS_CHUNK_MIB text of R rows, read back as the route reads it, gives R rows
    by the chunked backend's own rule: at V = 151,936 a budget of R rows' bytes written to 1e-6
    MiB read back one byte short, and R - 1 rows, for R = 2, 3, 5, 6, ..."""
    from benchmarks import HEADS
    from benchmarks.cases import env_vars
    from benchmarks.chunk_rows import budget_mib
    from grpo_kernels.chunked import loss_grad
    from grpo_kernels.ops import route

    monkeypatch.setattr(loss_grad, "MIN_ROWS", 1)  # as the benchmark's worker lifts it
    D, V = HEADS[head]
    n = 900
    for rows in [*range(1, 41), 96, 256, 512, n, n + 5]:
        text = budget_mib(rows, n, V, D, dtype, want_dw=not frozen)
        with env_vars({route.CHUNK_ENV: text}):
            budget = route.chunk_budget_bytes("chunked")
        got, why = loss_grad.chunk_rows(n, V, D, dtype, budget, want_dw=not frozen)
        assert got == min(rows, n), (rows, text, why)
