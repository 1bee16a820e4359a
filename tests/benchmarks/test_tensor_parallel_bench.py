"""benchmarks.tensor_parallel sets the three-pass route's chunk budget so that every tp runs
--chunk_rows rows per chunk (its rows differ only in V / tp): the budget it writes, read back as
the route reads it, gives exactly those rows at each shard width."""

from __future__ import annotations

import pytest

from benchmarks.tensor_parallel import chunk_mib
from grpo_kernels.kernels.linear_loss_grad import chunk_rows
from grpo_kernels.ops.route import CHUNK_ENV, chunk_budget_bytes


@pytest.mark.parametrize("rows", [16, 96, 256, 1024])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("V, D", [(151936, 896), (128256, 2048), (4096, 64)])
def test_chunk_budget_gives_the_asked_rows(monkeypatch, rows, tp, V, D):
    monkeypatch.setenv(CHUNK_ENV, chunk_mib(rows, V // tp, D))
    budget = chunk_budget_bytes("chunked")
    assert chunk_rows(10**6, V // tp, D, budget) == rows
