"""fused_linear_grpo_loss on the chunked backend with the gradient computed in the forward
(grpo_kernels/ops/three_pass.py) against the four-pass route (GRPO_KERNELS_THREE_PASS=0) and the
float64 reference: loss, metrics and the gradients of hidden, weight and bias, for every
token-level loss type × beta × temperature × delta × entropy bonus, packed and padded, frozen
heads, an incoming gradient other than 1, and a loss inside a larger graph. Plus the route's
decision and its reasons."""

import itertools
import logging

import pytest
import torch
from helpers import leaf, make_grpo_batch, make_head, max_err, on_device

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.chunked import loss_grad
from grpo_kernels.ops import route
from grpo_kernels.params import GRPOParams

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = (3, 47, 31, 123)  # B, T, D, V
BACKENDS = ["chunked", "triton"]  # Triton: on the GPU, or the kernels in the interpreter with
# torch.mm for cuBLAS (helpers.on_device runs the Triton cases on the GPU where there is one)
CELLS = list(itertools.product(gk.LOSS_TYPES, [0.0, 0.04], [1.0, 0.7], [None, 1.5], [0.0, 0.01]))


def problem(seed=0, bias=True, temperature=1.0, shape=SHAPE):
    B, T, D, V = shape
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=seed, bias=bias,
                                       scale=3.0)
    return (hidden, weight, b, ids), make_grpo_batch(hidden, weight, b, ids, seed=seed,
                                                     temperature=temperature)


def run(head, batch, kw, three=True, dtype=torch.float32, fn=None, frozen=(), grad=3.0,
        extra=None, backend="chunked"):
    """(loss, metrics, grads) of loss·grad (+ extra(h, w)) backward; `frozen`: the names of the
    head's tensors that do not require grad (their gradient is None)."""
    hidden, weight, bias, ids = head
    mask, adv, old, ref = batch
    h, w, b = leaf(hidden, dtype), leaf(weight, dtype), leaf(bias, dtype)
    for name, x in (("hidden", h), ("weight", w), ("bias", b)):
        if name in frozen and x is not None:
            x.requires_grad_(False)
    env = {} if three else {route.ENV: "0"}
    with gk.force_backend(backend), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        call = on_device(fn or gk.fused_linear_grpo_loss, backend)
        loss, metrics = call(h, w, ids, adv, mask, old, ref, b, **kw)
        total = loss * grad + (0.0 if extra is None else extra(h, w))
        total.backward()
    return loss.detach(), metrics, [None if x is None else x.grad for x in (h, w, b)]


def assert_same(ours, want, tol=1e-5):
    assert ours[0].dtype == torch.float32 and ours[0].dim() == 0
    assert max_err(ours[0], want[0]) <= tol * (1 + want[0].abs().item()), "loss"
    assert list(ours[1]) == list(want[1])
    for key, value in want[1].items():
        assert not ours[1][key].requires_grad
        assert max_err(ours[1][key], value) <= tol, key
    for name, o, t in zip(["d hidden", "d weight", "d bias"], ours[2], want[2]):
        assert (o is None) == (t is None), name
        if t is not None:
            assert o.dtype == t.dtype
            assert max_err(o, t) <= tol * max(t.abs().max().item(), 1e-3), name


def hyper(loss_type, beta, temperature, delta, entropy_coef):
    return dict(loss_type=loss_type, beta=beta, temperature=temperature, delta=delta,
                entropy_coef=entropy_coef, max_completion_length=64,
                epsilon_high=5.0 if loss_type == "cispo" else 0.28)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type,beta,temperature,delta,entropy_coef", CELLS)
def test_matches_the_four_pass_route(loss_type, beta, temperature, delta, entropy_coef,
                                     backend):
    kw = hyper(loss_type, beta, temperature, delta, entropy_coef)
    head, batch = problem(seed=1, temperature=temperature)
    assert route.linear_loss_route(leaf(head[0]), *head[1:3], backend,
                                   GRPOParams(**kw)).three_pass
    assert_same(run(head, batch, kw, backend=backend),
                run(head, batch, kw, three=False, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", gk.LOSS_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_the_float64_reference(loss_type, dtype, backend):
    """Within the four-pass route's own error bound (tests/api/test_fused_linear_grpo.py)."""
    kw = hyper(loss_type, 0.04, 0.7, 1.5, 0.01)
    head, batch = problem(seed=2, temperature=0.7)
    truth = run(head, batch, kw, dtype=torch.float64, fn=reference.fused_linear_grpo_loss)
    same = run(head, batch, kw, dtype=dtype, fn=reference.fused_linear_grpo_loss)
    ours = run(head, batch, kw, dtype=dtype, backend=backend)
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]
    assert max_err(ours[0], truth[0]) <= 2 * max_err(same[0], truth[0]) + tol * (
        1 + truth[0].abs().item())
    for key, value in truth[1].items():
        assert max_err(ours[1][key], value) <= 2 * max_err(same[1][key], value) + tol, key
    for o, s, t in zip(ours[2], same[2], truth[2]):
        assert o.dtype == dtype
        scale = max(t.abs().max().item(), 1e-3)
        assert max_err(o, t) <= 2 * max_err(s, t) + tol * scale


@pytest.mark.parametrize("frozen", [("weight", "bias"), ("hidden",), ("bias",),
                                    ("hidden", "bias")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_parts(frozen, backend):
    """A frozen head (no d weight, d bias), frozen hidden states, or a frozen bias alone."""
    kw = hyper("dapo", 0.04, 1.0, None, 0.01)
    head, batch = problem(seed=3)
    ours = run(head, batch, kw, frozen=frozen, backend=backend)
    assert_same(ours, run(head, batch, kw, three=False, frozen=frozen, backend=backend))
    for name, g in zip(("hidden", "weight", "bias"), ours[2]):
        assert (g is None) == (name in frozen)


@pytest.mark.parametrize("grad", [1.0, -0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_incoming_gradient_and_a_larger_graph(grad, backend):
    """loss·grad + something else of the head: the saved gradients are scaled, and the other
    term's gradients add to them."""
    kw = hyper("grpo", 0.04, 0.7, None, 0.01)
    head, batch = problem(seed=4, temperature=0.7)

    def extra(h, w):
        return (h ** 2).sum() * 1e-3 + w.sum() * 0.1

    assert_same(run(head, batch, kw, grad=grad, extra=extra, backend=backend),
                run(head, batch, kw, three=False, grad=grad, extra=extra, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_backward_of_a_retained_graph_recomputes(backend):
    kw = hyper("dapo", 0.04, 0.7, 1.5, 0.01)
    (hidden, weight, bias, ids), (mask, adv, old, ref) = problem(seed=5, temperature=0.7)
    h, w, b = leaf(hidden), leaf(weight), leaf(bias)
    with gk.force_backend(backend):
        loss, _ = on_device(gk.fused_linear_grpo_loss, backend)(h, w, ids, adv, mask, old, ref,
                                                                b, **kw)
    first = torch.autograd.grad(loss * 2.0, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(loss * 2.0, (h, w, b))
    for a, c in zip(first, second):
        # the recompute runs the backend's four-pass backward: equal to float32 rounding
        assert max_err(a, c) <= 1e-5 * max(c.abs().max().item(), 1e-3)


@pytest.mark.parametrize("cfg", ["plain", "entropy-bias-isr", "no_old-num_items"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_matches_padded(cfg, backend):
    """A packed batch (a length-1 and a zero-length sequence) on the three-pass path gives the
    padded call's loss, metrics and gradients on the same tokens."""
    from test_packed import lengths_for, make_batch, run_linear

    opts = {"plain": {}, "entropy-bias-isr": dict(bias=True, isr="N"),
            "no_old-num_items": dict(old=False)}[cfg]
    kw = dict(beta=0.04, temperature=0.7,
              entropy_coef=0.01 if cfg == "entropy-bias-isr" else 0.0,
              num_items_in_batch=13 if cfg == "no_old-num_items" else None)
    weight, b, padded, packed, real = make_batch(lengths_for(6), seed=6, temperature=0.7,
                                                 **opts)
    fn = on_device(gk.fused_linear_grpo_loss, backend)
    with gk.force_backend(backend):
        pad = run_linear(fn, weight, b, padded, kw)
        pack = run_linear(fn, weight, b, packed, kw)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(route.ENV, "0")
            present = run_linear(fn, weight, b, packed, kw)
    for ours, want in ((pack, pad), (pack, present)):
        assert max_err(ours[0], want[0]) <= 1e-5
        for key in want[1]:
            assert max_err(ours[1][key], want[1][key]) <= 1e-5, key
        dh = want[2][real] if want is pad else want[2]
        assert max_err(ours[2], dh) <= 1e-5 * dh.abs().max().item()
        for o, t in zip(ours[3], want[3]):
            assert max_err(o, t) <= 1e-5 * t.abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_chunks(monkeypatch, backend):
    """Chunks of 16 whole rows (a budget of 16 rows' buffers): several chunks, same results."""
    V, D = SHAPE[3], SHAPE[2]
    per_row = 2 * 4 * V if backend == "chunked" else V * 8 + D * 8
    monkeypatch.setenv(route.CHUNK_ENV, str(16 * per_row / 2**20))
    if backend == "chunked":  # past the chunked backend's minimum rows
        monkeypatch.setattr(loss_grad, "MIN_ROWS", 16)
    kw = hyper("sapo", 0.04, 0.7, None, 0.01)
    head, batch = problem(seed=7, temperature=0.7)
    assert_same(run(head, batch, kw, backend=backend),
                run(head, batch, kw, three=False, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_batch(backend):
    head, (mask, adv, old, ref) = problem(seed=8)
    loss, _, grads = run(head, (torch.zeros_like(mask), adv, old, ref), hyper(
        "dapo", 0.04, 1.0, None, 0.01), backend=backend)
    assert loss.item() == 0.0 and not any(g.any() for g in grads)


def _route(h, w, b, backend="chunked", **kw):
    per_token = kw.pop("per_token_outputs", False)
    softcap = kw.pop("softcap", None)
    grad_filter = kw.pop("grad_filter", None)
    return route.linear_loss_route(h, w, b, backend, GRPOParams(**kw), softcap, grad_filter,
                                   per_token_outputs=per_token)


def test_route_and_its_reasons(monkeypatch):
    h, w = leaf(torch.randn(10, 8)), leaf(torch.randn(40, 8))
    assert _route(h, w, None).three_pass
    assert _route(h, w, None, backend="triton").three_pass
    # an nn.Parameter head (every model's) and calls under a dispatch mode (the operator)
    assert _route(h, torch.nn.Parameter(w.detach()), None).three_pass
    from torch.utils._python_dispatch import TorchDispatchMode

    with TorchDispatchMode():
        assert _route(h, w, None).three_pass
    cases = {
        "return_terms": _route(h, w, None, per_token_outputs=True),
        "whole sequences": _route(h, w, None, importance_sampling_level="sequence"),
        "whole sequences ": _route(h, w, None, loss_type="vespo"),
        " whole sequences": _route(h, w, None, off_policy_mask_threshold=0.5),
        "whole sequences  ": _route(h, w, None, top_entropy_quantile=0.5),
        "soft cap": _route(h, w, None, softcap=30.0),
        "grad_filter": _route(h, w, None, backend="triton", grad_filter=0.0),
        "neither": _route(h.detach(), w.detach(), None),
        "grad mode": None,
    }
    with torch.no_grad():
        cases["grad mode"] = _route(h, w, None)
        # Triton: a call without a gradient takes the forward-only route (test_forward_only.py)
        fwd = {"grad mode": _route(h, w, None, backend="triton"),
               "grad mode ": _route(h, w, None, backend="triton", grad_filter=0.0)}
    fwd["neither"] = _route(h.detach(), w.detach(), None, backend="triton")
    for words, r in cases.items():
        assert r.path == route.FOUR_PASS and words.strip() in r.reason, (words, r)
    for words, r in fwd.items():
        assert r.forward_only and words.strip() in r.reason and "forward only" in r.reason
    monkeypatch.setenv(route.ENV, "0")
    assert not _route(h, w, None).three_pass
    assert "minimum-memory" in _route(h, w, None, backend="triton").reason
    monkeypatch.delenv(route.ENV)
    big = torch.empty(2_000_000, 8)  # the budget holds too few whole rows of 2M logits
    assert "fewer than" in _route(leaf(torch.randn(1024, 8)), big, None).reason
    assert _route(leaf(torch.randn(1024, 8)), big, None, backend="triton").three_pass
    # a frozen 16-bit head (LoRA's base) has no d W accumulator to hold: 12 MiB holds its
    # float32 copy (8 MiB) and 64 rows of 4,096 logits, not also a float32 [4096, 512] d W
    monkeypatch.setenv(route.CHUNK_ENV, "12")
    h16, w16 = leaf(torch.randn(64, 512, dtype=torch.bfloat16)), torch.randn(4096, 512).bfloat16()
    assert _route(h16, w16, None).three_pass
    trained = _route(h16, leaf(w16), None)
    assert not trained.three_pass and "d weight" in trained.reason, trained
    monkeypatch.setenv(route.CHUNK_ENV, "lots")
    with pytest.raises(ValueError, match="GRPO_KERNELS_CHUNK_MIB must be a number of MiB > 0"):
        _route(h, w, None)


def test_calls_that_keep_the_four_pass_route(monkeypatch):
    """no_grad scoring and return_terms never reach the three-pass launcher."""
    called = []
    launcher = loss_grad.linear_loss_grad
    monkeypatch.setattr(loss_grad, "linear_loss_grad",
                        lambda *a, **k: called.append(1) or launcher(*a, **k))
    (hidden, weight, bias, ids), (mask, adv, old, ref) = problem(seed=9)
    with gk.force_backend("chunked"):
        with torch.no_grad():
            gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old, ref, bias)
        terms = gk.fused_linear_grpo_loss(leaf(hidden), weight, ids, adv, mask, old, ref, bias,
                                          return_terms=True)
        assert terms.logp.requires_grad
        assert not called
        gk.fused_linear_grpo_loss(leaf(hidden), weight, ids, adv, mask, old, ref, bias)
    assert called == [1]


@pytest.mark.parametrize("three", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_create_graph_gives_first_order_gradients_and_no_second(three, monkeypatch, backend):
    """As on the four-pass route (whose linear-head op is once differentiable): the gradients
    come back under create_graph=True, and differentiating them raises."""
    if not three:
        monkeypatch.setenv(route.ENV, "0")
    (hidden, weight, bias, ids), (mask, adv, old, ref) = problem(seed=10)
    h, w = leaf(hidden), leaf(weight)
    with gk.force_backend(backend):
        loss, _ = on_device(gk.fused_linear_grpo_loss, backend)(h, w, ids, adv, mask, old, ref,
                                                                entropy_coef=0.01)
    gh, gw = torch.autograd.grad(loss, (h, w), create_graph=True)
    assert gh.requires_grad and gw.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (gh.sum() + gw.sum()).backward()


def test_the_route_is_logged_once_with_its_reason(caplog):
    with caplog.at_level(logging.INFO, logger="grpo_kernels"):
        assert route._log_route(route.LOSS, route.THREE_PASS, "a reason seen once") == (
            route.THREE_PASS)
        route._log_route(route.LOSS, route.THREE_PASS, "a reason seen once")
        assert route._log_route(route.LOSS, route.FOUR_PASS, "a reason seen once") == (
            route.FOUR_PASS)
        route._log_route(route.LOGPROBS, route.FORWARD_ONLY, "a reason seen once")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "grpo_kernels: linear-head loss on the three-pass route: a reason seen once",
        "grpo_kernels: linear-head loss on the four-pass route: a reason seen once",
        "grpo_kernels: selective log-probs on the forward-only route: a reason seen once"]
