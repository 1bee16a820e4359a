"""benchmarks/capacity.py: the search for the longest completion within a memory budget, and one
real probe at the tiny size."""

from types import SimpleNamespace

import pytest

capacity = pytest.importorskip("benchmarks.capacity")


def test_search_doubles_then_bisects_to_the_resolution(monkeypatch):
    seen = []

    def fake_probe(args, provider, length):  # fits up to 3000 tokens
        seen.append(length)
        return dict(length=length, fits=length <= 3000, peak_gib=length / 1000, status="ok")

    monkeypatch.setattr(capacity, "probe", fake_probe)
    args = SimpleNamespace(start=1024, max_length=131072, resolution=0.125)
    length, probes = capacity.search(args, "trl")
    assert seen == [1024, 2048, 4096, 3072, 2560, 2816] and length == 2816
    assert 3072 <= length * (1 + args.resolution) and all(n % 64 == 0 for n in seen)
    assert [p["length"] for p in probes] == seen
    # everything fits up to --max_length
    args.max_length = 2048
    assert capacity.search(args, "trl")[0] == 2048
    # the start misses: halve to a fit (4096 -> 2048), then bisect up to the miss
    seen.clear()
    args.max_length = 131072
    args.start = 8192
    assert capacity.search(args, "trl")[0] == 2816
    assert seen == [8192, 4096, 2048, 3072, 2560, 2816]
    # nothing fits, down to 64 tokens
    seen.clear()
    monkeypatch.setattr(capacity, "probe", lambda a, p, n: dict(length=n, fits=False,
                                                                 peak_gib=9.0, status="ok"))
    length, probes = capacity.search(args, "trl")
    assert length is None and [p["length"] for p in probes][-1] == 64


@pytest.mark.slow
def test_one_real_probe_at_the_tiny_size():
    pytest.importorskip("trl")
    args = SimpleNamespace(num_generations=2, prompt_tokens=16, device="cpu", beta=0.0, seed=0,
                           num_layers=None, tiny=True, budget_gib=16.0)
    result = capacity.probe(args, "trl-kernels", 64)
    assert result["status"] == "ok" and result["fits"] and 0 < result["peak_gib"] < 16
    assert result["malloc"] == "MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072"
    args.budget_gib = 0.05  # below the process' own RSS: stopped, a miss
    result = capacity.probe(args, "trl-kernels", 64)
    assert not result["fits"] and result["status"].startswith("stopped")


OLD_HEADER = ("timestamp,provider,budget_gib,memory_kind,capacity_tokens,model,num_generations,"
              "prompt_tokens,beta,probes,device,torch,transformers,trl,commit,command")


def test_long_tailed_search_per_layout_appends_rows_that_say_profile_and_layout(
        monkeypatch, tmp_path):
    """--length_profile long_tailed --layouts packed padded: each probe's trainer_step command
    parses to the long-tailed profile at the probed cap, the same seed, the asked layout; the
    row says the profile and the layout that ran, and the lengths drawn at the capacity vary
    under the cap. trainer_step itself is replaced by its argument parser and row description,
    with memory growing with the rows' positions (padded: G x the longest completion)."""
    import csv
    import json
    import statistics
    import subprocess

    import torch

    from benchmarks import device_slug, lengths, step_row, trainer_step

    commands, real_run = [], subprocess.run

    def fake_trainer_step(cmd, **kwargs):
        if cmd[1:3] != ["-m", "benchmarks.trainer_step"]:  # git, for the row's commit
            return real_run(cmd, **kwargs)
        a = trainer_step.parse_args(cmd[3:])
        commands.append(a)
        drawn = lengths.draw_lengths(a.length_profile, a.num_generations, a.completion_tokens,
                                     a.seed, call=0)
        body = (a.num_generations * max(drawn) if a.padding_free == "off" else sum(drawn))
        peak = (a.num_generations * a.prompt_tokens + body) / 4096  # GiB
        row = {**step_row.describe(a, False), "status": "ok",
               "completion_tokens_mean": round(statistics.mean(drawn), 1),
               "scoring_peak_gib": peak / 2, "loss_peak_gib": peak, "malloc": "fixed"}
        return subprocess.CompletedProcess(cmd, 0, "log line\n" + json.dumps(row, indent=1), "")

    monkeypatch.setattr(capacity.subprocess, "run", fake_trainer_step)
    path = tmp_path / f"{device_slug(torch.device('cpu'))}-capacity.csv"
    old_row = ("2026-01-01T00:00:00+00:00,trl,6.0,RSS,1920,model,2,64,0.0,1024:4.0:fit,cpu,"
               "2,5,1,abc,python -m benchmarks.capacity")
    path.write_text(OLD_HEADER + "\n" + old_row + "\n")
    status = capacity.main(["--providers", "fused", "--layouts", "packed", "padded",
                            "--length_profile", "long_tailed", "--num_generations", "8",
                            "--budget_gib", "4", "--start", "1024", "--out", str(tmp_path)])
    assert status == 0
    assert {a.length_profile for a in commands} == {"lognormal"}
    assert {a.seed for a in commands} == {0} and all(a.synthetic for a in commands)
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = reader.fieldnames, list(reader)
    assert header[:16] == OLD_HEADER.split(",")  # new columns at the end only
    assert {"length_profile", "layout", "capacity_lengths"} <= set(header[16:])
    assert rows[0]["capacity_tokens"] == "1920" and rows[0]["layout"] == ""  # the old row
    packed, padded = rows[1], rows[2]
    assert (packed["layout"], padded["layout"]) == ("packed", "padded")
    for row in (packed, padded):
        assert row["length_profile"] == "lognormal" and row["num_generations"] == "8"
        cap, drawn = int(row["capacity_tokens"]), [int(x) for x in row["capacity_lengths"].split()]
        assert len(drawn) == 8 and len(set(drawn)) > 1 and max(drawn) <= cap
        assert statistics.mean(drawn) < 0.75 * cap  # long-tailed: most well under the cap
        assert drawn == lengths.draw_lengths("lognormal", 8, cap, 0, call=0)
    assert int(packed["capacity_tokens"]) > int(padded["capacity_tokens"])
    # a layout the provider cannot run is refused before any probe
    commands.clear()
    with pytest.raises(SystemExit) as refused:
        capacity.main(["--providers", "trl", "--layouts", "packed", "--budget_gib", "4",
                       "--no_record"])
    assert refused.value.code == 2 and commands == []


def test_probe_takes_the_rounded_mean_of_the_draw(monkeypatch):
    """trainer_step rounds the row's mean completion length to 0.1 token: a draw whose mean ends
    in .x5 (2648.75 for G = 8 at cap 6656, seed 0) is the work asked for, not a failure."""
    import json
    import subprocess

    from benchmarks import lengths

    drawn = lengths.draw_lengths("lognormal", 8, 6656, 0, call=0)
    assert sum(drawn) / 8 == 2648.75
    row = {"status": "ok", "padding_free": "on", "share_prompt": "off", "loss_peak_gib": 5.7,
           "scoring_peak_gib": 2.0, "completion_tokens_mean": round(sum(drawn) / 8, 1)}
    monkeypatch.setattr(capacity.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, json.dumps(row, indent=1), ""))
    args = SimpleNamespace(num_generations=8, prompt_tokens=64, device="cpu", beta=0.0, seed=0,
                           num_layers=2, tiny=False, budget_gib=6.0,
                           length_profile="long_tailed", layout="packed")
    result = capacity.probe(args, "fused", 6656)
    assert result["status"] == "ok" and result["fits"] and result["lengths"] == drawn
    row["completion_tokens_mean"] = 6656.0  # every completion at the cap: not the draw
    assert capacity.probe(args, "fused", 6656)["status"].startswith("failed: completions")


@pytest.mark.slow
def test_real_long_tailed_probes_draw_under_the_cap_in_the_asked_layout():
    args = SimpleNamespace(num_generations=4, prompt_tokens=16, device="cpu", beta=0.0, seed=0,
                           num_layers=None, tiny=True, budget_gib=16.0,
                           length_profile="long_tailed")
    for layout in ("packed", "padded"):
        args.layout = layout
        result = capacity.probe(args, "fused", 64)
        assert result["status"] == "ok" and result["fits"] and result["layout"] == layout
        drawn = result["lengths"]
        assert len(drawn) == 4 and len(set(drawn)) > 1 and max(drawn) <= 64 > min(drawn)
