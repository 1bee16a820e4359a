"""benchmarks.row_tiles on the CPU (Triton's interpreter): the race of the logits row kernels'
launch configurations writes each row as it is measured, so a device step cut short by its
timeout keeps the configurations raced before."""

from __future__ import annotations

import csv

import pytest

from benchmarks import row_tiles


def test_each_row_is_written_as_it_is_measured(tmp_path, monkeypatch):
    real, calls = row_tiles.time_call, []

    def third_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("cut short")
        return real(*args, **kwargs)

    monkeypatch.setattr(row_tiles, "time_call", third_fails)
    with pytest.raises(KeyboardInterrupt):
        row_tiles.main(["--head", "tiny", "--tokens", "8", "--device", "cpu",
                        "--out", str(tmp_path)])
    (path,) = tmp_path.glob("cpu-*-row-tiles.csv")
    rows = list(csv.DictReader(path.open()))
    assert [(r["kernel"], r["default"]) for r in rows] == [("forward", "True"),
                                                          ("forward", "False")], rows
    assert all(float(r["ms"]) > 0 and float(r["max_diff"]) < 1e-3 for r in rows), rows
