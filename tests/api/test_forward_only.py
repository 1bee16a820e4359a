"""The forward-only route (grpo_kernels/ops/route.py): a linear-head GRPO loss or a selective
log-prob call that wants no gradient runs, on the Triton backend, per chunk of rows the library
GEMM into float32 logits and the Triton row forward. Against the four-pass forward
(GRPO_KERNELS_THREE_PASS=0): loss, metrics and per-token values for several loss types,
temperature, bias, the entropy bonus, packed batches; selective log-probs against their
grad-mode values; bf16 against float64; several chunks; the route's decision and its line."""

import logging

import pytest
import torch
from helpers import KERNEL_DEVICE, leaf, max_err, on_device
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels import gemm
from grpo_kernels.kernels import linear_loss_grad as triton_loss_grad
from grpo_kernels.ops import route
from grpo_kernels.ops.backends import IMPLS
from grpo_kernels.params import GRPOParams

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = (3, 11, 16, 75)  # B, T, D, V
LINE = "forward only: cuBLAS chunks + row kernel"


class PassThrough(TorchDispatchMode):
    """A dispatch mode that runs every op as it is (a memory tracker's kind)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def problem(seed=0, bias=True, temperature=1.0):
    """The three-pass tests' head and batch (test_three_pass.problem) at this file's shape."""
    from test_three_pass import problem as three_pass_problem

    return three_pass_problem(seed, bias, temperature, SHAPE)


def _plain(out):
    """(loss, metrics, the token values as a dict): what on_device can move."""
    values = {} if len(out) == 2 else out[2]._asdict()
    return out[0], out[1], {k: v for k, v in values.items() if v is not None}


def score(head, batch, kw, four=False, how="no_grad", dtype=torch.float32, fn=None,
          backend="triton"):
    """(loss, metrics, token values) of a call that wants no gradient: under torch.no_grad()
    with tensors that require grad, or with none that does (how="frozen")."""
    hidden, weight, bias, ids = head
    h, w, b = (leaf(x, dtype) if how == "no_grad" else x if x is None else x.to(dtype)
               for x in (hidden, weight, bias))

    def call(*args, **kwargs):
        with torch.set_grad_enabled(how != "no_grad"):
            if fn is not None:  # the reference: (loss, metrics)
                return _plain(fn(*args, **kwargs))
            return _plain(gk.fused_linear_grpo_loss(*args, return_token_values=True, **kwargs))

    with gk.force_backend(backend), pytest.MonkeyPatch.context() as mp:
        if four:
            mp.setenv(route.ENV, "0")
        out = on_device(call, backend)(h, w, ids, *batch[1:2], batch[0], *batch[2:], b, **kw)
    assert not out[0].requires_grad
    return out


def assert_same(ours, want, mask, tol=1e-5):
    assert max_err(ours[0], want[0]) <= tol * (1 + want[0].abs().item()), "loss"
    assert list(ours[1]) == list(want[1])
    for key, value in want[1].items():
        assert max_err(ours[1][key], value) <= tol, key
    assert ours[2].keys() == want[2].keys()
    kept = mask.reshape(-1).bool()  # the route computes the tokens the loss reads
    for key, value in want[2].items():
        if value.dim() == 0:
            assert max_err(ours[2][key], value) <= tol * (1 + value.abs().item()), key
        else:
            o, t = ours[2][key].reshape(-1)[kept], value.reshape(-1)[kept]
            assert max_err(o, t) <= tol * (1 + t.abs().max().item()), key


def hyper(loss_type, beta=0.04, temperature=1.0, entropy_coef=0.0, **extra):
    return dict(loss_type=loss_type, beta=beta, temperature=temperature,
                entropy_coef=entropy_coef, max_completion_length=64,
                epsilon_high=5.0 if loss_type == "cispo" else 0.28, **extra)


CELLS = [("grpo", 1.0, True, 0.0), ("dapo", 0.7, True, 0.01), ("dr_grpo", 0.7, False, 0.0),
         ("cispo", 1.0, False, 0.01), ("sapo", 0.7, True, 0.0), ("bnpo", 1.0, True, 0.01)]


@pytest.mark.parametrize("how", ["no_grad", "frozen"])
@pytest.mark.parametrize("loss_type,temperature,bias,entropy_coef", CELLS)
def test_loss_matches_the_four_pass_forward(loss_type, temperature, bias, entropy_coef, how):
    kw = hyper(loss_type, temperature=temperature, entropy_coef=entropy_coef, delta=1.5)
    head, batch = problem(seed=1, bias=bias, temperature=temperature)
    assert_same(score(head, batch, kw, how=how), score(head, batch, kw, four=True, how=how),
                batch[0])


def test_packed_loss_matches_the_four_pass_forward():
    from test_packed import lengths_for, make_batch

    weight, b, _, packed, _ = make_batch(lengths_for(6), seed=6, bias=True, isr="N",
                                         temperature=0.7)
    kw = dict(beta=0.04, temperature=0.7, entropy_coef=0.01,
              cu_seqlens=packed["cu_seqlens"], importance_sampling_ratio=packed["isr"])
    head = (packed["hidden"], weight, b, packed["ids"])
    mask = torch.ones(head[0].shape[0])
    mask[2] = 0.0  # a token masked inside a sequence
    batch = (mask, packed["adv"], packed["old"], packed["ref"])
    assert_same(score(head, batch, kw), score(head, batch, kw, four=True), mask)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_bf16_against_the_float64_reference(loss_type):
    """Within twice PyTorch's own bf16 error (the reference in bf16) against float64."""
    kw = hyper(loss_type, temperature=0.7, entropy_coef=0.01)
    head, batch = problem(seed=2, temperature=0.7)
    truth = score(head, batch, kw, dtype=torch.float64, fn=reference.fused_linear_grpo_loss,
                  backend="chunked")
    same = score(head, batch, kw, dtype=torch.bfloat16, fn=reference.fused_linear_grpo_loss,
                 backend="chunked")
    ours = score(head, batch, kw, dtype=torch.bfloat16)
    tol = 1e-2
    assert max_err(ours[0], truth[0]) <= 2 * max_err(same[0], truth[0]) + tol * (
        1 + truth[0].abs().item())
    for key, value in truth[1].items():
        assert max_err(ours[1][key], value) <= 2 * max_err(same[1][key], value) + tol, key


def test_several_chunks_and_masked_rows_not_computed(monkeypatch):
    """A budget of 4 rows' buffer: several chunks, the same numbers; the GEMMs see only the
    tokens the loss reads (the padded batch is compacted)."""
    kw = hyper("dapo", temperature=0.7, entropy_coef=0.01)
    head, batch = problem(seed=3, temperature=0.7)
    one = score(head, batch, kw)
    V, D = SHAPE[3], SHAPE[2]
    monkeypatch.setenv(route.CHUNK_ENV, str(4 * (V * 4 + D * 8) / 2**20))
    rows = []
    product = gemm.product
    monkeypatch.setattr(gemm, "product", lambda out, *a, **k: rows.append(out.shape[0])
                        or product(out, *a, **k))
    several = score(head, batch, kw)
    assert len(rows) > 2 and max(rows) == 4 and sum(rows) == int(batch[0].sum())
    assert_same(several, one, batch[0], tol=2e-6)


def _logprobs(hidden, weight, ids, bias, grad, **kw):
    fn = on_device(gk.selective_logprobs, "triton")
    with gk.force_backend("triton"), torch.set_grad_enabled(grad):
        return fn(hidden, weight, ids, bias, return_entropy=True, **kw)


@pytest.mark.parametrize("kw", [{}, dict(temperature=0.7), dict(softcap=3.0, logit_scale=0.8)])
def test_selective_logprobs_no_grad_equals_grad_mode(kw, monkeypatch):
    (hidden, weight, bias, ids), _ = problem(seed=4)
    called = []
    chunks = triton_loss_grad.linear_logprob_forward_gemm
    monkeypatch.setattr(triton_loss_grad, "linear_logprob_forward_gemm",
                        lambda *a, **k: called.append(1) or chunks(*a, **k))
    scored = _logprobs(leaf(hidden), leaf(weight), ids, leaf(bias), False, **kw)
    assert called == [1]
    graded = _logprobs(leaf(hidden), leaf(weight), ids, leaf(bias), True, **kw)
    assert called == [1] and graded[0].requires_grad and not scored[0].requires_grad
    for o, t in zip(scored, graded):
        t = t.detach()
        assert o.shape == t.shape and max_err(o, t) <= 1e-5 * (1 + t.abs().max().item())


def test_selective_logprobs_bf16_against_float64():
    (hidden, weight, bias, ids), _ = problem(seed=5)
    with torch.no_grad():
        truth = reference.selective_logprobs(hidden.double(), weight.double(), ids,
                                             bias.double(), temperature=0.7)
        bf = [x.bfloat16() for x in (hidden, weight, bias)]
        same = reference.selective_logprobs(bf[0], bf[1], ids, bf[2], temperature=0.7)
    ours = _logprobs(bf[0], bf[1], ids, bf[2], False, temperature=0.7)[0]
    assert max_err(ours, truth) <= 2 * max_err(same, truth) + 1e-2


def test_route_and_its_line(monkeypatch, caplog):
    h, w = leaf(torch.randn(10, 8)), leaf(torch.randn(40, 8))
    params = GRPOParams()
    with torch.no_grad():
        loss = route.linear_loss_route(h, w, None, "triton", params, grad_filter=0.0)
        chunked = route.linear_loss_route(h, w, None, "chunked", params)
        logprobs = route.logprobs_route(h, w, None, "triton", direct=True)
        seen = route.logprobs_route(h, w, None, "triton", direct=False)
    frozen = route.linear_loss_route(h.detach(), w.detach(), None, "triton", params)
    assert loss.forward_only and LINE in loss.reason and "grad mode" in loss.reason
    assert frozen.forward_only and "neither" in frozen.reason
    assert logprobs.forward_only and LINE in logprobs.reason
    assert not chunked.forward_only and "grad mode" in chunked.reason
    assert seen.path == route.FOUR_PASS and "operator" in seen.reason
    assert route.logprobs_route(h, w, None, "triton", direct=True).path == route.FOUR_PASS
    with torch.no_grad():  # the options a forward-only call does not take
        for kw in (dict(softcap=30.0), dict(per_token_outputs=True)):
            assert not route.linear_loss_route(h, w, None, "triton", params, **kw).forward_only
        assert not route.linear_loss_route(h, w, None, "triton", GRPOParams(
            importance_sampling_level="sequence")).forward_only
        monkeypatch.setenv(route.ENV, "0")
        assert "minimum-memory" in route.linear_loss_route(h, w, None, "triton", params).reason
        assert not route.logprobs_route(h, w, None, "triton", direct=True).forward_only
    monkeypatch.delenv(route.ENV)
    # the line, once, from a real call (a fresh set of logged routes)
    monkeypatch.setattr(route, "_LOGGED", set())
    head, batch = problem(seed=6)
    with caplog.at_level(logging.INFO, logger="grpo_kernels"):
        score(head, batch, hyper("dapo"))
        score(head, batch, hyper("dapo"))
        _logprobs(*head[:2], head[3], head[2], False)
        hidden, weight, bias, ids = (x.to(KERNEL_DEVICE) for x in head)
        with PassThrough(), torch.no_grad(), gk.force_backend("triton"):
            gk.selective_logprobs(hidden, weight, ids, bias)  # the operator: four-pass
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("grpo_kernels: linear-head loss on the forward-only route: "
                               "no gradient: grad mode is off; " + LINE)
    assert lines[1].startswith("grpo_kernels: selective log-probs on the forward-only route")
    assert "selective log-probs on the four-pass route" in lines[2]


def test_four_pass_setting_keeps_the_fused_forward(monkeypatch):
    """GRPO_KERNELS_THREE_PASS=0: the fused forward kernel, never the chunks."""
    called = []
    chunks = triton_loss_grad.linear_logprob_forward_gemm
    monkeypatch.setattr(triton_loss_grad, "linear_logprob_forward_gemm",
                        lambda *a, **k: called.append("chunks") or chunks(*a, **k))
    fused = IMPLS["triton"].linear_logprob_forward
    monkeypatch.setattr(IMPLS["triton"], "linear_logprob_forward",
                        lambda *a, **k: called.append("fused") or fused(*a, **k))
    head, batch = problem(seed=7)
    score(head, batch, hyper("grpo"), four=True)
    monkeypatch.setenv(route.ENV, "0")
    _logprobs(*head[:2], head[3], head[2], False)
    assert called == ["fused", "fused"]
    monkeypatch.delenv(route.ENV)
    score(head, batch, hyper("grpo"))
    _logprobs(*head[:2], head[3], head[2], False)
    assert called == ["fused", "fused", "chunks", "chunks"]
