"""benchmarks.profile_head: the per-kernel profile of a provider's forward + backward."""

import csv

import pytest

from benchmarks import profile_head


def test_rows_per_kernel_and_provider(tmp_path, capsys):
    assert profile_head.main(["--head", "tiny", "--tokens", "64", "--device", "cpu",
                              "--dtype", "float32", "--warmup", "0", "--steps", "1",
                              "--providers", "ours", "reference", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-profile.csv")
    rows = list(csv.DictReader(path.open()))
    by_provider = {}
    for r in rows:
        by_provider.setdefault(r["provider"], []).append(r)
        assert r["head"] == "tiny" and r["N"] == "64" and r["commit"] and r["date"]
    assert set(by_provider) == {"ours", "reference"}
    for provider, rs in by_provider.items():
        assert sum(float(r["share"]) for r in rs) == pytest.approx(1.0, abs=0.01)
        times = [float(r["ms_per_step"]) for r in rs]
        assert times == sorted(times, reverse=True), provider  # largest first
        # the head's matrix products are there: on a CPU, as ATen's mm/addmm
        assert any(r["kernel"] in ("aten::mm", "aten::addmm") for r in rs), provider
    assert "| ours |" in capsys.readouterr().out


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        profile_head.main(["--steps", "0", "--device", "cpu"])
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_head.main(["--providers", "nope", "--device", "cpu"])
    assert "--providers" in capsys.readouterr().err
