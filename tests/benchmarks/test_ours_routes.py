"""The two routes of ours in the kernel sweep: `ours` (the library's default call) and
`ours-4pass` (GRPO_KERNELS_THREE_PASS=0), on heads that are nn.Parameter as a model's lm_head is.
Each sets its variables around its own forward and backward only, both compute the reference's
loss and gradients, and both get CPU memory rows."""

from __future__ import annotations

import os

import pytest
import torch

import grpo_kernels
from benchmarks import make_shape
from benchmarks.cases import NotMeasured
from benchmarks.providers import NAMES, PROVIDERS, LossConfig, fused_inputs, select
from benchmarks.runner import sweep

CPU = torch.device("cpu")
ENV = {"device": "test", "torch": torch.__version__, "triton": "-", "commit": "-"}
SHAPE = make_shape("tiny", 64)  # D=128, V=4096, B=8 sequences of T=8, ~25% padding
VAR = "GRPO_KERNELS_THREE_PASS"
# the chunked PyTorch backend (as on a CPU outside the tests): tests/conftest.py switches
# Triton's interpreter on, far too slow at this head
CFG = LossConfig(backend="chunked")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_heads_are_parameters_and_hidden_states_plain_tensors():
    h, w, *_ = fused_inputs(SHAPE, torch.float32, CPU, CFG)
    assert type(w) is torch.nn.Parameter and w.requires_grad and w.shape == (SHAPE.V, SHAPE.D)
    assert type(h) is torch.Tensor and h.requires_grad and h.is_leaf


def test_both_routes_are_registered_in_sweep_order():
    assert "fused_linear/ours-4pass" in PROVIDERS and PROVIDERS["fused_linear/ours-4pass"].note
    chosen = [p.name for p in select(["fused_linear"], NAMES)]
    assert chosen[:2] == ["ours", "ours-4pass"]
    assert chosen.index("ours-4pass") < chosen.index("trl") < chosen.index("reference")
    assert PROVIDERS["fused_linear/ours-4pass"].unavailable(CPU) is None


@pytest.mark.parametrize("outer", [None, "1", "0"])
@pytest.mark.parametrize("name, inside", [("ours", None), ("ours-4pass", "0"),
                                          ("ours-atomic", "0")])
def test_each_variant_sets_the_route_around_its_own_calls(monkeypatch, outer, name, inside):
    """The variable as the loss call and the backward see it, and as it is after them: the
    provider's value inside (None: unset, the library's default), the caller's outside."""
    if outer is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, outer)
    seen = []
    call = grpo_kernels.fused_linear_grpo_loss

    def spy(*args, **kwargs):
        seen.append(("forward", os.environ.get(VAR)))
        return call(*args, **kwargs)

    monkeypatch.setattr(grpo_kernels, "fused_linear_grpo_loss", spy)
    case = PROVIDERS[f"fused_linear/{name}"].build(SHAPE, torch.float32, CPU, CFG)
    case.leaves[0].register_hook(lambda g: seen.append(("backward", os.environ.get(VAR))))
    case.step("fwd+bwd")()
    assert os.environ.get(VAR) == outer
    if "backward" in case.unmeasured:  # the three-pass route: no backward mode (next test)
        with pytest.raises(NotMeasured):
            case.step("backward")
        assert seen == [("forward", inside), ("backward", inside)]
        return
    step = case.step("backward")  # its forward runs here, the backward in the call
    assert os.environ.get(VAR) == outer
    step()
    assert os.environ.get(VAR) == outer
    assert seen == [("forward", inside), ("backward", inside)] * 2
    assert (f"{VAR}=0" in case.note) == (inside == "0")


def test_both_routes_give_the_reference_loss_and_gradients():
    from grpo_kernels import reference

    cfg = CFG
    h, w, ids, adv, mask, old, ref = fused_inputs(SHAPE, torch.float32, CPU, cfg)
    want = reference.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, **cfg.ours())[0]
    want_grads = torch.autograd.grad(want, (h, w))
    for name in ("ours", "ours-4pass"):
        case = PROVIDERS[f"fused_linear/{name}"].build(SHAPE, torch.float32, CPU, cfg)
        loss = case.loss()
        loss.backward()
        torch.testing.assert_close(loss, want, rtol=2e-5, atol=2e-6)
        for got, exp in zip((t.grad for t in case.leaves), want_grads):
            torch.testing.assert_close(got, exp, rtol=2e-5, atol=2e-6)


def test_both_routes_get_cpu_memory_rows():
    """Peak above the inputs for forward and fwd+bwd on both routes (torch.profiler counts
    inside the library's operators), and the variable is unset again after the sweep."""
    providers = [PROVIDERS["fused_linear/ours"], PROVIDERS["fused_linear/ours-4pass"]]
    before = os.environ.get(VAR)
    rows = sweep(providers, [SHAPE], ["forward", "fwd+bwd"], torch.float32, CPU, CFG, {}, ENV,
                 "test", timing={"budget_s": 0})
    assert os.environ.get(VAR) == before
    assert [(r["provider"], r["mode"]) for r in rows] == [
        ("ours", "forward"), ("ours-4pass", "forward"), ("ours", "fwd+bwd"),
        ("ours-4pass", "fwd+bwd")]
    for r in rows:
        assert r["status"] == "ok" and r["peak_above_mib"] > 0, r
        assert "memory: torch.profiler allocations" in r["note"]


def test_three_pass_backward_mode_times_no_recompute(monkeypatch):
    """The three-pass route forms the gradient in the forward; a training step's backward only
    hands it to autograd. The backward mode's repeated backward of one retained graph would
    recompute it on every call (the four-pass backward), a cost no step pays: so `ours` on that
    route gets no backward row, and its forward, which does the whole work, no rate (as Liger's,
    whose gradient is formed in the forward too). The four-pass route keeps every row."""
    from grpo_kernels.ops import three_pass_op

    recomputed = []
    real = three_pass_op.recompute_grads
    monkeypatch.setattr(three_pass_op, "recompute_grads",
                        lambda *a, **kw: recomputed.append(1) or real(*a, **kw))
    providers = [PROVIDERS["fused_linear/ours"], PROVIDERS["fused_linear/ours-4pass"]]
    rows = sweep(providers, [SHAPE], ["forward", "backward", "fwd+bwd"], torch.float32, CPU,
                 CFG, {"matmul_tflops": 1.0}, ENV, "test", memory=False,
                 timing={"budget_s": 0})
    assert not recomputed
    got = {(r["provider"], r["mode"]): r for r in rows}
    assert got["ours", "backward"]["status"].startswith("n/a: three-pass route")
    assert got["ours", "backward"].get("ms_p50") is None
    assert got["ours", "forward"]["status"] == "ok" and got["ours", "forward"].get("tflops") is None
    assert "three-pass route" in got["ours", "forward"]["note"]
    assert got["ours", "fwd+bwd"]["tflops"] > 0
    for mode in ("forward", "backward", "fwd+bwd"):
        assert got["ours-4pass", mode]["status"] == "ok" and got["ours-4pass", mode]["tflops"] > 0
