"""benchmarks.profile_head: the per-kernel profile of a provider's forward + backward."""

import csv

import pytest
import torch

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
    assert {r["route"] for r in by_provider["reference"]} == {""}  # not our loss: no route
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


def test_each_profile_names_its_route_and_a_wrong_one_is_not_written(tmp_path, capsys,
                                                                     monkeypatch):
    import grpo_kernels

    # the chunked backend, as a CPU runs it outside the tests (the interpreter: minutes here)
    with grpo_kernels.force_backend("chunked"):
        _routes_named(tmp_path, capsys, monkeypatch)


def _routes_named(tmp_path, capsys, monkeypatch):
    args = ["--head", "tiny", "--tokens", "64", "--device", "cpu", "--dtype", "float32",
            "--warmup", "0", "--steps", "1", "--providers", "ours", "ours-4pass",
            "--out", str(tmp_path)]
    assert profile_head.main(args) == 0
    out = capsys.readouterr().out
    assert "ours: route: three-pass" in out and "ours-4pass: route: four-pass" in out
    (path,) = tmp_path.glob("*-profile.csv")
    routes = {(r["provider"], r["route"]) for r in csv.DictReader(path.open())}
    assert routes == {("ours", "three-pass"), ("ours-4pass", "four-pass")}  # also in the rows
    # the rule says three-pass when `ours` is built, and its calls then take four passes
    from grpo_kernels.ops import route

    decide, seen = route.linear_loss_route, []

    def later_four_pass(*a, **kw):
        seen.append(1)
        return decide(*a, **kw) if len(seen) == 1 else route.Route(route.FOUR_PASS, "test")

    monkeypatch.setattr(route, "linear_loss_route", later_four_pass)
    (path,) = tmp_path.glob("*-profile.csv")
    before = path.read_text()
    assert profile_head.main(args[:-4] + ["ours", "--out", str(tmp_path)]) == 1
    assert "ours: wrong route: took four-pass, expected three-pass" in capsys.readouterr().out
    assert path.read_text() == before


OLD_HEADER = ("device,date,commit,provider,head,N,kernel,calls_per_step,ms_per_step,share,"
              "command")


def test_a_file_without_the_route_column_is_rewritten_before_rows_are_appended(tmp_path):
    """A results file written before the route column: its rows keep their cells (the route
    empty) and the new rows line up under the whole header, never under the old one."""
    from benchmarks import device_slug

    path = tmp_path / f"{device_slug(torch.device('cpu'))}-profile.csv"
    path.write_text(OLD_HEADER + "\nCPU,2026-01-01,abc,ours,tiny,64,aten::mm,2.0,1.5,0.9,cmd\n")
    assert profile_head.main(["--head", "tiny", "--tokens", "64", "--device", "cpu",
                              "--dtype", "float32", "--warmup", "0", "--steps", "1",
                              "--providers", "reference", "--out", str(tmp_path)]) == 0
    reader = csv.DictReader(path.open())
    rows = list(reader)
    assert tuple(reader.fieldnames) == profile_head.COLUMNS
    assert rows[0] == dict(device="CPU", date="2026-01-01", commit="abc", provider="ours",
                           route="", head="tiny", N="64", kernel="aten::mm",
                           calls_per_step="2.0", ms_per_step="1.5", share="0.9", command="cmd")
    assert len(rows) > 1 and all(r["provider"] == "reference" and r["head"] == "tiny"
                                 and r["command"].startswith("python -m benchmarks")
                                 for r in rows[1:])


def test_a_file_with_other_columns_is_refused(tmp_path, capsys):
    from benchmarks import device_slug

    path = tmp_path / f"{device_slug(torch.device('cpu'))}-profile.csv"
    path.write_text("device,mystery\nCPU,1\n")
    with pytest.raises(SystemExit):
        profile_head.main(["--device", "cpu", "--head", "tiny", "--tokens", "64",
                           "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--out" in err and "mystery" in err
    assert path.read_text() == "device,mystery\nCPU,1\n"
