"""benchmarks.three_pass_knobs on the CPU (Triton's interpreter, torch.mm for cuBLAS): the race
of the three-pass route's chunk budget and row kernels runs the real launcher, names the
chunking each budget gives, and reports a candidate that computes differently."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import three_pass_knobs as knobs

TINY = dict(V=300, D=32)  # per row: 300·4 + 32·8 = 1,456 bytes


def test_race_rows_default_first_and_exact(monkeypatch):
    rows = list(knobs.race("qwen0.5b", 64, torch.bfloat16, torch.device("cpu"), [0.02, 0.04],
                           **TINY))
    assert [(r["budget_mib"], r["row_kernels"], r["default"]) for r in rows] == [
        (704.0, "two", True), (0.02, "two", False), (0.02, "fused", False),
        (0.04, "two", False), (0.04, "fused", False)]
    # 48 computed rows (a quarter dropped): one chunk, chunks of 14 and of 16 rows
    assert [r["chunk_rows"] for r in rows] == [48, 14, 14, 16, 16]
    assert all(r["rows"] == 48 and r["ms"] > 0 and r["peak_above_mib"] is None for r in rows)
    # the same numbers in every chunking and with either row kernels: log-probs exactly, d W
    # (float32 sums in another order, then rounded to bf16) within its rounding
    assert all(r["max_diff_logp"] == 0.0 and r["max_rel_diff_dweight"] < 1e-2 for r in rows)


def test_a_candidate_that_computes_differently_shows(monkeypatch):
    real = knobs.one_call

    def skewed(*args):
        fn = real(*args)
        if not args[-1]:  # the two-kernel candidates: as they are
            return fn

        def call():
            out = fn()
            out.logp.add_(1e-3)
            out.d_weight.mul_(1.5)
            return out
        return call

    monkeypatch.setattr(knobs, "one_call", skewed)
    rows = list(knobs.race("tiny", 32, torch.bfloat16, torch.device("cpu"), [0.02], **TINY))
    fused = [r for r in rows if r["row_kernels"] == "fused"]
    assert fused and all(r["max_diff_logp"] > 5e-4 and r["max_rel_diff_dweight"] > 0.2
                         for r in fused), rows


def test_main_writes_rows_and_refuses_bad_arguments(tmp_path, capsys):
    assert knobs.main(["--heads", "tiny", "--tokens", "32", "--budgets_mib", "0.02",
                       "--device", "cpu", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cpu-*-three-pass-knobs.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 3 and list(rows[0]) == list(knobs.COLUMNS)
    assert all(r["commit"] and r["command"].startswith("python -m benchmarks.three_pass_knobs")
               for r in rows)
    assert capsys.readouterr().out.startswith("| head | budget MiB |")
    for bad, name in ((["--heads", "gpt9"], "--heads"), (["--budgets_mib", "0,1"],
                                                         "--budgets_mib"),
                      (["--budgets_mib", "x"], "--budgets_mib"), (["--tokens", "2"], "--tokens")):
        with pytest.raises(SystemExit) as exc:
            knobs.main([*bad, "--device", "cpu", "--out", str(tmp_path)])
        assert exc.value.code == 2
        assert name in capsys.readouterr().err


def test_each_row_is_written_as_it_is_measured(tmp_path, monkeypatch):
    """A run cut short (the device step's timeout) keeps the rows measured before: here the
    second candidate's timing fails, and the default's row is in the CSV."""
    real, calls = knobs.time_call, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("cut short")
        return real(*args, **kwargs)

    monkeypatch.setattr(knobs, "time_call", second_fails)
    with pytest.raises(KeyboardInterrupt):
        knobs.main(["--heads", "tiny", "--tokens", "32", "--budgets_mib", "0.02",
                    "--device", "cpu", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("cpu-*-three-pass-knobs.csv")
    rows = list(csv.DictReader(path.open()))
    assert [r["default"] for r in rows] == ["True"], rows


def test_the_default_budgets_follow_the_routes_default(monkeypatch):
    """Half the route's default budget, the default, twice: read from the library, so a new
    default moves the race with it."""
    from grpo_kernels.kernels import linear_loss_grad

    monkeypatch.setattr(linear_loss_grad, "CUDA_BUDGET_BYTES", 1000 * 2**20)
    assert knobs.default_budgets_mib() == (500.0, 1000.0, 2000.0)
