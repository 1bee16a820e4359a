"""benchmarks.sdpa_probe on the CPU (cold and warm decode attention per sdpa backend, the
profiled default's ops), and benchmarks.generation's --sdpa_backends (every generate call under
those backends, named in the rows)."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import generation, sdpa_probe

FLAGS = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled,
         "flash": torch.backends.cuda.flash_sdp_enabled,
         "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
         "math": torch.backends.cuda.math_sdp_enabled}


def test_probe_rows_on_the_cpu(tmp_path, capsys):
    assert sdpa_probe.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-sdpa.csv")
    rows = list(csv.DictReader(path.open()))
    timed, profiled = rows[:10], rows[10:]
    assert [(r["call"], r["backend"]) for r in timed] == [
        (c, b) for c in ("gqa", "masked") for b in ("default", "cudnn", "flash", "efficient",
                                                     "math")]
    spans = [(int(r["first_L"]), int(r["last_L"])) for r in rows]
    assert spans[0] == (100, 103)  # --first_L's default; 4 lengths a block under --tiny
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))  # no length met twice
    for r in timed:
        assert r["date"] and r["commit"] and r["command"].startswith("python -m benchmarks.")
        if r["backend"] in ("cudnn", "efficient"):  # no CPU kernel: a row that says so
            assert r["status"].startswith("no available kernel: "), r
            assert r["cold_ms_median"] == "", r
            continue
        assert r["status"] == "ok", r
        cold = [float(c) for c in r["cold_ms"].split(";")]
        assert len(cold) == 4 and all(c > 0 for c in cold)
        assert float(r["cold_ms_median"]) > 0 and float(r["warm_ms_median"]) > 0
        assert float(r["cold_warm_ratio"]) == pytest.approx(
            float(r["cold_ms_median"]) / float(r["warm_ms_median"]), rel=0.01)
    assert [(r["call"], r["backend"], r["status"]) for r in profiled] == [
        ("gqa", "default", "profiled"), ("masked", "default", "profiled")]
    for r in profiled:  # the CPU's choice for bf16 decode: its flash kernel, 2 calls seen
        assert r["ran"] == "flash" and r["cudnn_ran"] == "False", r
        assert "aten::_scaled_dot_product_flash_attention_for_cpu:2:" in r["sdpa_ops"], r
        assert r["kernels"] == ""
    out = capsys.readouterr().out
    assert "gqa     math" in out and "profiled masked (default" in out


def test_probe_bad_arguments_name_the_flag(capsys):
    for argv, flag in ((["--lengths", "0"], "--lengths"), (["--calls", "gqa,x"], "--calls"),
                       (["--backends", "default,tensorrt"], "--backends"),
                       (["--first_L", "1"], "--first_L")):
        with pytest.raises(SystemExit):
            sdpa_probe.main(["--device", "cpu", "--no_record", *argv])
        assert flag in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="--sdpa_backends: expected a comma list of cudnn"):
        sdpa_probe.parse_backends("flash,flex")
    assert sdpa_probe.parse_backends("flash, math") == [
        torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.MATH]


@pytest.mark.parametrize("backends", [None, "math"])
def test_generation_runs_every_call_under_the_backends(tmp_path, monkeypatch, backends):
    """Each sdpa call of the run (the untimed call's and the timed one's) sees only the backends
    asked for; the rows name them, "default" when none were."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(frozenset(name for name, enabled in FLAGS.items() if enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    out = tmp_path / "gen.csv"
    argv = ["--workloads", "trainer-64", "--tiny", "--max_new", "6", "--prompt_tokens", "12",
            "--paths", "padded", "--threads", "1", "--repeats", "1", "--warmup_tokens", "2",
            "--out", str(out)] + ([] if backends is None else ["--sdpa_backends", backends])
    before = {name: enabled() for name, enabled in FLAGS.items()}
    assert generation.main(argv) == 0
    assert {name: enabled() for name, enabled in FLAGS.items()} == before  # restored after
    (row,) = csv.DictReader(out.open())
    assert row["sdpa_backends"] == (backends or "default") and row["ran_path"] == "padded"
    # two layers a forward; the untimed call's 2 tokens, then the timed call's (up to 7)
    assert len(seen) >= 2 * (2 + 3)
    expected = frozenset(FLAGS) if backends is None else frozenset(backends.split(","))
    assert set(seen) == {expected}


def test_generation_rejects_an_unknown_backend(capsys):
    with pytest.raises(SystemExit):
        generation.main(["--sdpa_backends", "flash,cuddn"])
    assert "--sdpa_backends: expected a comma list of cudnn" in capsys.readouterr().err
