"""What a sweep row says beside its time: the work it is rated on (6·N·V·D for a fused linear
step, three passes over the logits for the logits path, both over the positions the loss reads)
and the route our loss calls took, observed in the call itself and checked against the one the
provider stands for."""

from __future__ import annotations

import pytest
import torch

from benchmarks import flops, head_flops, logits_bytes, make_shape
from benchmarks.providers import PROVIDERS, LossConfig
from benchmarks.runner import sweep

CPU = torch.device("cpu")
ENV = {"device": "test", "torch": torch.__version__, "triton": "-", "commit": "-"}
SHAPE = make_shape("tiny", 64)  # D=128, V=4096, 8 sequences of 8, ~25 % padding
CFG = LossConfig(backend="chunked")  # the CPU's backend (not Triton's interpreter)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_a_step_of_the_head_counts_two_products_forward_and_four_backward():
    nvd = float(SHAPE.N) * SHAPE.V * SHAPE.D
    assert flops(SHAPE, "forward") == flops(SHAPE, "score") == 2 * nvd
    assert flops(SHAPE, "backward") == 4 * nvd  # d hidden and d weight
    assert flops(SHAPE, "fwd+bwd") == 6 * nvd == flops(SHAPE, "forward") + flops(SHAPE,
                                                                                  "backward")
    assert flops(SHAPE, "fwd+bwd", rows=10) == head_flops(10, SHAPE.V, SHAPE.D, "fwd+bwd")


def _rows(names, modes, **kw):
    providers = [PROVIDERS[f"fused_linear/{n}"] for n in names]
    return sweep(providers, [SHAPE], modes, torch.float32, CPU, CFG, {"matmul_tflops": 1.0},
                 ENV, "test", memory=False, timing={"budget_s": 0}, **kw)


def test_rates_count_six_nvd_over_the_unmasked_positions():
    """The rate is 6·P·V·D / time with P the unmasked positions (the same mask for every
    provider), and the row says P beside the time; % of the ceiling follows the same count."""
    case = PROVIDERS["fused_linear/reference"].build(SHAPE, torch.float32, CPU, CFG)
    positions = int(case.keep[2].sum())  # the mask
    assert 0 < positions < SHAPE.N
    del case
    rows = _rows(["ours", "ours-4pass", "reference"], ["fwd+bwd"])
    for r in rows:
        assert r["status"] == "ok", r
        want = 6.0 * positions * SHAPE.V * SHAPE.D / (r["ms_p50"] * 1e-3) / 1e12
        assert r["tflops"] == pytest.approx(want, rel=1e-9), r
        assert r["pct_ceiling"] == pytest.approx(100 * want, rel=1e-9)
        assert f"rate on {positions} of {SHAPE.N} positions" in r["note"], r


def test_logits_rates_count_the_bytes_of_the_unmasked_positions():
    """The logits path's GB/s counts its passes (1 forward, 2 backward, 3 fwd+bwd) over the
    logits of the P unmasked positions, as the head's FLOPs are counted, and says P."""
    case = PROVIDERS["logits/reference"].build(SHAPE, torch.float32, CPU, CFG)
    positions = int(case.keep[2].sum())  # the mask
    assert 0 < positions < SHAPE.N and case.positions == positions
    del case
    rows = sweep([PROVIDERS["logits/reference"]], [SHAPE], ["forward", "fwd+bwd"],
                 torch.float32, CPU, CFG, {"copy_gbps": 1.0}, ENV, "test", memory=False,
                 timing={"budget_s": 0})
    for r, passes in zip(rows, (1, 3), strict=True):
        assert r["status"] == "ok", r
        want = passes * positions * SHAPE.V * 4 / (r["ms_p50"] * 1e-3) / 1e9
        assert r["gbps"] == pytest.approx(want, rel=1e-9), r
        assert r["pct_ceiling"] == pytest.approx(100 * want, rel=1e-9)
        assert f"rate on {positions} of {SHAPE.N} positions" in r["note"], r
    assert logits_bytes(SHAPE, "backward", 2, rows=10) == 2 * 10 * SHAPE.V * 2


def test_each_row_names_the_route_its_calls_took():
    rows = _rows(["ours", "ours-4pass", "reference"], ["score", "forward", "fwd+bwd"])
    got = {(r["provider"], r["mode"]): r for r in rows}
    assert all(r["status"] == "ok" for r in rows), rows
    for mode in ("forward", "fwd+bwd"):
        assert "route: three-pass" in got["ours", mode]["note"]
        assert "route: four-pass" in got["ours-4pass", mode]["note"]
    # without a gradient (chunked backend): the four-pass forward, on both
    assert "route: four-pass" in got["ours", "score"]["note"]
    assert "route:" not in got["reference", "fwd+bwd"].get("note", "")  # not our loss call


def test_a_call_that_takes_another_route_than_its_provider_is_not_ok(monkeypatch):
    """`ours` stands for the three-pass route: if its calls take the four-pass route (here the
    variable is set for the whole process after the case was built, as a library change of the
    rule would do), its rows say so instead of "ok"."""
    from benchmarks.cases import Provider

    build = PROVIDERS["fused_linear/ours"].build

    def late_switch(*args):
        case = build(*args)
        monkeypatch.setenv("GRPO_KERNELS_THREE_PASS", "0")
        case.env.clear()  # the case no longer unsets it around its calls
        return case

    ours = Provider("fused_linear", "ours", late_switch, lambda device: None)
    (row,) = sweep([ours], [SHAPE], ["fwd+bwd"], torch.float32, CPU, CFG, {}, ENV, "test",
                   memory=False, timing={"budget_s": 0})
    assert row["status"] == "wrong route: took four-pass, expected three-pass", row
    assert "route: four-pass" in row["note"]


def test_a_device_timing_is_sized_on_a_warm_call(monkeypatch):
    """time_cuda gives do_bench a window of at least five calls; the first call of a provider
    compiles (Triton, torch.compile), so a window sized on it spent minutes of a device run on
    repetitions. Here (CUDA's events and do_bench stood in for by the host clock) a first call
    of 0.4 s and later ones of 1 ms get the 100 ms window."""
    import time

    import triton.testing

    from benchmarks import measure

    class Event:
        def __init__(self, **_):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    seen = {}

    def do_bench(fn, warmup, rep, grad_to_none, quantiles):
        seen["rep"] = rep
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.4 if len(calls) == 1 else 0.001)

    measure.time_cuda(fn)
    assert seen["rep"] < 150, seen  # not 5 × 400 ms
