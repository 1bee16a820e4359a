"""The benchmark harness runs end to end on CPU: one tiny sweep through `python -m benchmarks`'
entry point into a temporary directory (CSV columns, header once, plot), and a sweep with
simulated out-of-memory / failing / unavailable providers that records them and goes on."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import make_shape
from benchmarks.__main__ import format_table, main
from benchmarks.measure import LiveStorageTracker, is_oom
from benchmarks.providers import PROVIDERS, Case, LossConfig, Provider
from benchmarks.runner import COLUMNS, CsvLog, read_csv, sweep

CPU = torch.device("cpu")
ENV = {"device": "test", "torch": torch.__version__, "triton": "-", "commit": "-"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tiny_args(tmp_path, *extra):
    # tiny head: D=128, V=4096; N=64 -> B=8 sequences of T=8. The chunked PyTorch backend is
    # forced because tests/conftest.py switches the (slow) Triton interpreter on.
    return ["--heads", "tiny", "--tokens", "64", "--kernels", "fused_linear",
            "--providers", "ours,reference", "--modes", "forward,fwd+bwd", "--backend", "chunked",
            "--out", str(tmp_path), "--no-ceilings", "--cpu-budget", "0", "--device", "cpu", *extra]


def test_cli_sweep_writes_csv_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(_tiny_args(tmp_path, "--plot", str(png))) == 0
    assert main(_tiny_args(tmp_path, "--markdown")) == 0  # a second run appends
    out = capsys.readouterr().out
    assert "| kernel | provider |" in out

    files = list(tmp_path.glob("*.csv"))
    assert len(files) == 1 and files[0].name.startswith("cpu-")
    with files[0].open(newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == COLUMNS
    assert sum(line == COLUMNS for line in lines) == 1  # header written once
    rows = read_csv(files[0])
    assert len(rows) == 2 * 2 * 2  # 2 runs × 2 providers × 2 modes (no ceilings measured)
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["ms_p50"]) > 0
        # ours on the three-pass route forms its gradient in the forward: no forward rate
        unrated = (r["provider"], r["mode"]) == ("ours", "forward")
        assert (r["tflops"] == "") if unrated else float(r["tflops"]) > 0
        assert float(r["peak_above_mib"]) > 0
        if r["provider"] == "ours":  # custom operators, which the live-storage tracker cannot
            assert "memory: torch.profiler allocations" in r["note"]  # see into
        assert r["device"].startswith("CPU ") and r["command"].startswith("python -m benchmarks")
        assert (r["head"], r["n_tokens"], r["batch"], r["seq_len"]) == ("tiny", "64", "8", "8")
    assert {r["provider"] for r in rows} == {"ours", "reference"}
    assert all("backend=chunked" in r["note"] for r in rows if r["provider"] == "ours")
    assert png.exists() and png.stat().st_size > 10_000

    # --from-csv re-prints the latest matching rows without measuring (README tables)
    assert main(["--from-csv", str(files[0]), "--modes", "fwd+bwd", "--markdown"]) == 0
    shown = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| fused")]
    assert len(shown) == 2 and all("| fwd+bwd |" in ln for ln in shown)


def _fake(name, build, unavailable=lambda d: None):
    return Provider("fused_linear", name, build, unavailable, note="simulated")


def _oom_in_call(shape, dtype, device, cfg):
    x = torch.randn(4, requires_grad=True)

    def loss():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    return Case(loss, [x], 16)


def _oom_in_build(shape, dtype, device, cfg):
    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")


def _broken(shape, dtype, device, cfg):
    raise ValueError("something else")


def test_sweep_records_oom_errors_and_unavailable(tmp_path):
    shape = make_shape("tiny", 64)
    providers = [
        _fake("oom-call", _oom_in_call),
        _fake("oom-build", _oom_in_build),
        _fake("broken", _broken),
        _fake("absent", _broken, lambda d: "not installed"),
        PROVIDERS["fused_linear/reference"],  # still measured after all of the above
    ]
    log = CsvLog(tmp_path / "r.csv")
    rows = sweep(providers, [shape], ["forward", "fwd+bwd"], torch.float32, CPU, LossConfig(),
                 {"matmul_tflops": 1.0}, ENV, "test", log)
    status = {(r["provider"], r["mode"]): r["status"] for r in rows}
    assert status[("oom-call", "forward")] == status[("oom-call", "fwd+bwd")] == "OOM"
    assert status[("oom-build", "forward")] == "OOM"
    assert status[("broken", "fwd+bwd")].startswith("error: ValueError")
    assert status[("absent", "-")] == "n/a: not installed"
    assert status[("reference", "forward")] == status[("reference", "fwd+bwd")] == "ok"
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(r["pct_ceiling"] == pytest.approx(100 * r["tflops"]) for r in ok)
    assert len(read_csv(tmp_path / "r.csv")) == len(rows)
    table = format_table(rows)
    assert "OOM" in table and "n/a: not installed" in table


def test_time_budget_skips_the_rest():
    shape = make_shape("tiny", 64)
    rows = sweep([PROVIDERS["fused_linear/reference"]], [shape, shape], ["forward"],
                 torch.float32, CPU, LossConfig(), {}, ENV, "test", time_budget_s=0.0)
    assert [(r["status"], r["shape"]) for r in rows] == [("skipped: time budget", shape.label)] * 2


def test_oom_classification_and_live_bytes():
    assert is_oom(torch.OutOfMemoryError("x"))
    assert not is_oom(RuntimeError("shape mismatch"))
    a = torch.randn(256, 256, requires_grad=True)
    with LiveStorageTracker() as tracker:
        (a @ a).square().sum().backward()
    # forward: a@a and its square (256 KiB each) alive together; a.grad is created in backward
    assert tracker.peak >= 2 * 256 * 256 * 4
    assert tracker.current <= tracker.peak


def test_cpu_memory_inside_custom_operators_comes_from_the_profiler():
    """grpo_kernels' custom operators run below the dispatch-mode tracker, which would
    under-count them: such a call is measured again under torch.profiler's allocation events,
    which see inside operators; plain PyTorch calls keep the tracker."""
    import grpo_kernels as gk
    from benchmarks.measure import memory_cpu

    h = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(128, 16)
    ids = torch.randint(0, 128, (64,))
    with gk.force_backend("chunked"):
        ours = memory_cpu(lambda: gk.selective_logprobs(h, w, ids).sum().backward(), [h],
                          h.numel() * 4, 0)
    assert ours is not None and ours.method == "torch.profiler allocations"
    assert ours.peak_bytes >= 64 * 128 * 4  # the [N, V] float32 logits tile lives inside it
    measured = memory_cpu(lambda: (h @ w.T).logsumexp(-1).sum().backward(), [h], h.numel() * 4, 0)
    assert measured is not None and measured.method == "live tensor storages"
    assert measured.peak_bytes >= 64 * 128 * 4


def test_cpu_providers_are_timed_in_turns():
    """CPU: one warm-up call each, then rounds A, B, A, B, ...; a call that raises leaves the
    turns and its exception comes back in its place."""
    from benchmarks.measure import time_cpu_interleaved

    calls = []

    def call(key):
        return lambda: calls.append(key)

    def broken():
        calls.append("c")
        raise RuntimeError("boom")

    out = time_cpu_interleaved({"a": (call("a"), []), "b": (call("b"), []), "c": (broken, [])},
                               budget_s=0)
    assert calls == ["a", "b", "c"] + ["a", "b"] * 3
    assert out["a"].reps == out["b"].reps == 3
    assert isinstance(out["c"], RuntimeError) and out["c"].__traceback__ is None


def test_score_mode_runs_without_a_graph(tmp_path):
    """--modes score: the loss under torch.no_grad (a scoring call), no gradient, a rated row."""
    args = _tiny_args(tmp_path)
    args[args.index("forward,fwd+bwd")] = "score"
    assert main(args) == 0
    rows = read_csv(next(tmp_path.glob("*.csv")))
    assert {(r["provider"], r["mode"], r["status"]) for r in rows} == {
        ("ours", "score", "ok"), ("reference", "score", "ok")}
    assert all(float(r["tflops"]) > 0 for r in rows)
    case = PROVIDERS["fused_linear/reference"].build(make_shape("tiny", 64), torch.float32, CPU,
                                                     LossConfig(backend="chunked"))
    case.step("score")()
    assert all(t.grad is None for t in case.leaves)
