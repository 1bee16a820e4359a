"""The peer providers of the kernel sweep (TRL's head, Cut Cross-Entropy): registered, reported
"n/a" with a reason where their package or device is missing, and, where they run on CPU,
computing the same loss and gradients as the reference at a tiny shape."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import make_shape
from benchmarks.peer_providers import loss_from_logps, trl_logps
from benchmarks.providers import NAMES, PROVIDERS, LossConfig, fused_inputs, select
from benchmarks.runner import sweep

CPU = torch.device("cpu")
ENV = {"device": "test", "torch": torch.__version__, "triton": "-", "commit": "-"}
SHAPE = make_shape("tiny", 64)  # D=128, V=4096, B=8 sequences of T=8, ~25% padding

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_peers_are_registered_in_sweep_order():
    for name in ("trl", "cce", "cce-filter"):
        assert name in NAMES and f"fused_linear/{name}" in PROVIDERS
        assert PROVIDERS[f"fused_linear/{name}"].note
    chosen = [p.name for p in select(["fused_linear", "logits"], NAMES)]
    # only the fused linear kernel has peers; the compiled reference still runs last
    assert chosen.index("trl") < chosen.index("cce") < chosen.index("reference")
    assert chosen[-1] == "reference-compile"
    assert not any(k.startswith("logits/") and k.split("/")[1] in ("trl", "cce")
                   for k in PROVIDERS)


@pytest.mark.parametrize("blocked, name, reason", [
    ("cut_cross_entropy", "cce", "cut-cross-entropy not installed"),
    ("trl.kernels.chunked_logprob", "trl", "trl not installed"),
    ("trl.trainer.utils", "trl", "trl not installed"),
])
def test_missing_package_is_a_reason_not_a_failure(monkeypatch, blocked, name, reason):
    monkeypatch.setitem(sys.modules, blocked, None)  # `import` of it now raises ImportError
    provider = PROVIDERS[f"fused_linear/{name}"]
    assert provider.unavailable(CPU) == reason
    rows = sweep([provider, PROVIDERS["fused_linear/reference"]], [SHAPE], ["forward"],
                 torch.float32, CPU, LossConfig(), {}, ENV, "test")
    assert [(r["provider"], r["status"]) for r in rows] == [
        (name, f"n/a: {reason}"), ("reference", "ok")]


def test_cce_filter_needs_cuda():
    assert "needs CUDA" in PROVIDERS["fused_linear/cce-filter"].unavailable(CPU)


def _against_reference(name: str):
    """(peer loss, reference loss, peer grads, reference grads) on the same inputs."""
    from grpo_kernels import reference

    cfg = LossConfig()
    case = PROVIDERS[f"fused_linear/{name}"].build(SHAPE, torch.float32, CPU, cfg)
    loss = case.loss()
    loss.backward()
    h, w, ids, adv, mask, old, ref = fused_inputs(SHAPE, torch.float32, CPU, cfg)  # same seed
    want = reference.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, **cfg.ours())[0]
    want.backward()
    return loss, want, [t.grad for t in case.leaves], [h.grad, w.grad]


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_trl_head_gives_the_reference_loss_and_gradients():
    pytest.importorskip("trl.kernels.chunked_logprob")
    pytest.importorskip("trl.trainer.utils")
    loss, want, grads, want_grads = _against_reference("trl")
    _close(loss, want)
    for g, w in zip(grads, want_grads):
        _close(g, w)


def test_trl_entropy_and_its_gradient_match_the_reference():
    """TRL's head also gives the entropy: with an entropy bonus its gradient flows through
    TRL's backward, and the loss still equals the reference's."""
    pytest.importorskip("trl.trainer.utils")
    from grpo_kernels import reference

    hyper = dict(LossConfig().ours(), entropy_coef=0.05)
    h, w, ids, adv, mask, old, ref = fused_inputs(SHAPE, torch.float32, CPU, LossConfig())
    logp, ent = trl_logps(h, w, ids, mask, 1.0)
    want_logp, want_ent = reference.selective_logprobs(h, w, ids, return_entropy=True)
    keep = mask.bool()
    _close(logp[keep], want_logp[keep])
    _close(ent[keep], want_ent[keep])
    loss = loss_from_logps(logp, ent, h, w, ids, adv, mask, old, ref, hyper)[0]
    got = torch.autograd.grad(loss, (h, w))
    want = reference.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, **hyper)[0]
    _close(loss, want)
    for g, r in zip(got, torch.autograd.grad(want, (h, w))):
        _close(g, r)


@pytest.mark.slow  # CCE compiles its torch_compile impl (about 10 s on 2 cores)
def test_cce_gives_the_reference_loss_and_gradients(monkeypatch):
    """CCE's torch_compile impl on CPU (no entropy: the loss has no entropy bonus here)."""
    pytest.importorskip("cut_cross_entropy")
    # the provider turns buffer donation off for its process: restored for the tests after
    monkeypatch.setattr(torch._functorch.config, "donated_buffer",
                        torch._functorch.config.donated_buffer)
    loss, want, grads, want_grads = _against_reference("cce")
    _close(loss, want)
    for g, w in zip(grads, want_grads):
        _close(g, w)
    # in a sweep, the CPU memory tracker (a dispatch mode, under which its fullgraph compile
    # raises) is left out, and the backward mode (retain_graph=True, again and again) runs
    rows = sweep([PROVIDERS["fused_linear/cce"]], [SHAPE], ["forward", "backward"],
                 torch.float32, CPU, LossConfig(), {}, ENV, "test", timing={"budget_s": 0})
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r.get("peak_mib") is None for r in rows)


def test_cce_refuses_an_entropy_bonus():
    h, w, ids, adv, mask, old, ref = fused_inputs(SHAPE, torch.float32, CPU, LossConfig())
    logp = torch.zeros(SHAPE.B, SHAPE.T, requires_grad=True)
    with pytest.raises(ValueError, match="no entropy"):
        loss_from_logps(logp, None, h, w, ids, adv, mask, old, ref,
                        dict(LossConfig().ours(), entropy_coef=0.05))


def test_the_callers_order_is_kept_with_compiled_last():
    names = ["reference", "liger", "reference-compile", "ours", "trl"]
    chosen = [p.name for p in select(["fused_linear"], names)]
    assert chosen == ["reference", "liger", "ours", "trl", "reference-compile"]
