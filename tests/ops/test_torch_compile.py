"""torch.compile: the public losses are custom operators (grpo_kernels/ops/custom_ops.py), so a
compiled training step that calls them traces with fullgraph=True (no graph break anywhere in
validation or dispatch) and gives eager's loss, metrics and gradients; `torch.library.opcheck`
checks each operator's schema, fake (meta) implementation and autograd registration.

Runs on both backends: the Triton kernels in the interpreter and the chunked PyTorch path."""

import functools

import pytest
import torch
from helpers import leaf, make_grpo_batch, make_head, scaled_err

import grpo_kernels as gk
from benchmarks.measure import LiveStorageTracker
from grpo_kernels import chunked
from grpo_kernels.chunked import linear_launchers
from grpo_kernels.grpo_math import grpo_metrics, metric_names
from grpo_kernels.loss_call import terms_args as _terms_args
from grpo_kernels.ops import custom_ops
from grpo_kernels.ops.op_scalars import WithScalars
from grpo_kernels.ops.three_pass_op import LOSS_GRAD_OP
from grpo_kernels.params import GRPOParams
from grpo_kernels.validation import LossInputs

pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ["triton", "chunked"]
KW = dict(beta=0.04, epsilon_high=0.28, entropy_coef=0.01)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def problem(seed=0, B=2, T=5, D=8, V=37):
    hidden, weight, bias, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=seed, bias=True,
                                          scale=2.0)
    return (hidden, weight, bias, ids), make_grpo_batch(hidden, weight, bias, ids, seed=seed)


def linear_step(h, w, b, ids, mask, adv, old, ref, **kw):
    loss, metrics = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, b, **{**KW, **kw})
    return loss * 1.0, metrics


def module_step(h, w, b, ids, mask, adv, old, ref, loss_fn):
    return loss_fn(h, w, ids, adv, mask, old, ref, b)


def logits_step(h, w, b, ids, mask, adv, old, ref, **kw):
    loss, metrics = gk.grpo_loss(h @ w.T + b, ids, adv, mask, old, ref, **{**KW, **kw})
    return loss, metrics


def logprob_step(h, w, b, ids, *_):
    logp, ent = gk.selective_logprobs(h, w, ids, b, temperature=0.7, return_entropy=True)
    logp2 = gk.logprobs_from_logits(h @ w.T + b, ids, temperature=0.7)
    return (logp * 0.3 + logp2).sum() + 0.1 * ent.sum(), {}


def run(step, compiled, head, grpo, **kw):
    hidden, weight, bias, ids = head
    h, w, b = leaf(hidden), leaf(weight), leaf(bias)
    fn = torch.compile(step, fullgraph=True, backend=compiled) if compiled else step
    loss, metrics = fn(h, w, b, ids, *grpo, **kw)
    loss.backward()
    return [loss.detach(), *metrics.values(), h.grad, w.grad, b.grad], list(metrics)


def assert_same(ours, want, exact):
    (o_vals, o_keys), (w_vals, w_keys) = ours, want
    assert o_keys == w_keys
    for o, w in zip(o_vals, w_vals):
        if exact:
            assert torch.equal(o, w), (o, w)
        else:  # inductor may fuse the surrounding PyTorch ops differently
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)


STEPS = {
    "fused_linear_grpo_loss": (linear_step, {}),
    "fused_linear_grpo_loss-sequence": (linear_step, dict(importance_sampling_level="sequence")),
    "fused_linear_grpo_loss-cispo": (linear_step, dict(loss_type="cispo", epsilon_high=4.0)),
    "grpo_loss": (logits_step, {}),
    "selective_logprobs+logprobs_from_logits": (logprob_step, {}),
}


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("recompute_tiles")
def test_fullgraph_eager_backend_matches_eager(backend, name):
    step, kw = STEPS[name]
    head, grpo = problem()
    with gk.force_backend(backend):
        want = run(step, None, head, grpo, **kw)
        ours = run(step, "eager", head, grpo, **kw)
    assert_same(ours, want, exact=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("recompute_tiles")
def test_modules_compile(backend):
    head, grpo = problem(seed=1)
    with gk.force_backend(backend):
        loss_fn = gk.FusedLinearGRPOLoss(beta=0.04, loss_type="grpo", grad_filter="auto")
        want = run(module_step, None, head, grpo, loss_fn=loss_fn)
        ours = run(module_step, "eager", head, grpo, loss_fn=loss_fn)
    assert_same(ours, want, exact=True)


@pytest.mark.slow
def test_inductor_matches_eager():
    """The default backend (inductor, C++ codegen on CPU) around the fused loss."""
    head, grpo = problem(seed=2)
    want = run(linear_step, None, head, grpo)
    ours = run(linear_step, "inductor", head, grpo)
    assert_same(ours, want, exact=False)


def test_no_recompile_for_new_values_and_value_errors_inside_the_op():
    """Token ids and advantages are checked inside the op: a compiled step still raises the
    eager error naming the argument, and new values reuse the graph."""
    head, grpo = problem(seed=3)
    hidden, weight, bias, ids = head
    counts = torch._dynamo.utils.counters
    counts.clear()
    fn = torch.compile(linear_step, fullgraph=True, backend="eager")
    fn(hidden, weight, bias, ids, *grpo)
    fn(hidden, weight, bias, (ids + 1) % weight.shape[0], *grpo)
    assert counts["stats"]["unique_graphs"] == 1
    with pytest.raises(ValueError, match=r"completion_ids has token id \d+ outside \[0, 37\)"):
        fn(hidden, weight, bias, ids + weight.shape[0], *grpo)
    mask, adv, old, ref = grpo
    with pytest.raises(ValueError, match="advantages contain NaN"):
        fn(hidden, weight, bias, ids, mask, adv * float("nan"), old, ref)
    # the mask's check is an in-graph assertion around the op
    with pytest.raises(RuntimeError, match="completion_mask contains NaN or inf"):
        fn(hidden, weight, bias, ids, mask / 0.0, adv, old, ref)
    assert counts["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("loss_type", gk.ALL_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_metric_names_follow_grpo_metrics(loss_type, beta):
    params = GRPOParams(loss_type=loss_type, beta=beta, max_completion_length=4)
    x = torch.rand(2, 3)
    phi = torch.rand(2, 1) if params.spec.objective.sequence_weight else None  # vespo's φ
    keys = grpo_metrics(x, x + 0.5, x if beta else None, torch.randn(2, 1), torch.ones(2, 3),
                        params, vespo_phi=phi).keys()
    assert metric_names(params) == tuple(keys)


def _opcheck(op, args, all_checks=True):
    tests = ["test_autograd_registration", "test_aot_dispatch_dynamic"]
    tests += ["test_schema", "test_faketensor"] * all_checks
    result = torch.library.opcheck(op, args, test_utils=tests)
    assert len(result) == len(tests)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_selective_ops(backend):
    (hidden, weight, bias, ids), _ = problem(B=1, T=3, D=4, V=5)
    h, w, b = (leaf(x).reshape(-1, x.shape[-1]) if x.dim() > 1 else leaf(x)
               for x in (hidden, weight, bias))
    flat = ids.reshape(-1)
    ops = custom_ops.OPS  # .args: the hyperparameters as the operators take them (0-d tensors)
    _opcheck(ops.linear_logprobs.default,
             ops.linear_logprobs.args(h.detach().requires_grad_(), w, b, flat, 0.7, None,
                                      backend, "targets"))
    logits = leaf(hidden @ weight.T).detach().requires_grad_()
    _opcheck(ops.logits_logprobs.default,
             ops.logits_logprobs.args(logits, flat, 0.7, backend, "targets", False))


def _linear_call(call, head):
    hidden, weight, bias, ids = head
    h, w, b = leaf(hidden.reshape(-1, hidden.shape[-1])), leaf(weight), leaf(bias)
    logp, ent, lse, lse_sum = call(h, w, b, ids.reshape(-1), 0.7, None, "chunked", "targets")
    (logp * 0.3 + ent).sum().backward()
    return [logp, ent, lse, h.grad, w.grad, b.grad, lse_sum], type(logp.grad_fn).__name__


def _logits_call(call, head, inplace):
    hidden, weight, bias, ids = head
    x = leaf(hidden @ weight.T + bias)
    y = x * 1.0  # the op may write d logits over its input: not over the leaf
    logp, ent, lse, lse_terms = call(y, ids.reshape(-1), 0.7, "chunked", "targets", inplace)
    (logp * 0.3 + ent).sum().backward()
    return [logp, ent, lse, x.grad, lse_terms], type(logp.grad_fn).__name__


@pytest.mark.parametrize("inplace", [False, True])
def test_eager_selective_ops_match_the_operators(inplace, monkeypatch):
    """On the chunked backend a plain eager call of OPS.linear_logprobs / logits_logprobs runs
    the operators' eager bodies as an autograd.Function: bitwise the operators' outputs and
    gradients (in place too); their backwards from what the forward kept (the linear head's
    logits tile, the logits path's per-token statistics) match them to float32 rounding; under
    a dispatch mode the operator itself runs."""
    head, _ = problem(seed=5)
    ops = torch.ops.grpo_kernels
    op = {name: WithScalars(getattr(ops, name)) for name in ("linear_logprobs", "logits_logprobs")}
    calls = {"linear_logprobs": _linear_call,
             "logits_logprobs": functools.partial(_logits_call, inplace=inplace)}
    kept = {name: call(getattr(custom_ops.OPS, name), head)[0] for name, call in calls.items()}
    # bitwise: the backwards recompute (the tile) and read the lse (the statistics) too
    monkeypatch.setattr(linear_launchers, "KEEP_ELEMENTS", 0)
    logits_forward = chunked.logits_logprob_forward
    monkeypatch.setattr(chunked, "logits_logprob_forward",
                        lambda *args, keep=None, **kw: logits_forward(*args, **kw))
    for name, call in calls.items():
        fast, fast_node = call(getattr(custom_ops.OPS, name), head)
        want, op_node = call(op[name], head)
        assert "GeneratedBackwardFor" in op_node and "GeneratedBackwardFor" not in fast_node
        for a, b in zip(fast, want):
            assert torch.equal(a, b)
        for i, (a, b) in enumerate(zip(kept[name], want)):
            assert torch.equal(a, b) if i < 3 else scaled_err(a, b) < 1e-6
    with LiveStorageTracker() as tracker:  # a dispatch mode: it must see the operator
        _linear_call(custom_ops.OPS.linear_logprobs, head)
    assert tracker.opaque


def test_eager_linear_op_keeps_its_tile_for_one_backward(monkeypatch):
    """The eager linear op keeps its logits tile only when a gradient will be needed, and a
    second backward of the same graph (retain_graph) recomputes the tile: same gradients."""
    (hidden, weight, bias, ids), _ = problem(seed=6)
    seen = []
    forward = chunked.linear_logprob_forward

    def spy(*args, keep=None, **kw):
        out = forward(*args, keep=keep, **kw)
        seen.append(None if keep is None else sorted(keep))
        return out

    monkeypatch.setattr(chunked, "linear_logprob_forward", spy)
    h, w = leaf(hidden.reshape(-1, hidden.shape[-1])), leaf(weight)
    args = (h, w, None, ids.reshape(-1), 0.7, None, "chunked", "targets")
    with torch.no_grad():
        custom_ops.OPS.linear_logprobs(*args)
    custom_ops.OPS.linear_logprobs(h.detach(), w.detach(), *args[2:])
    logp, ent, *_ = custom_ops.OPS.linear_logprobs(*args)
    assert seen == [None, None, ["log_sum", "tile"]]
    loss = (logp * 0.3 + ent).sum()
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w))
    for a, b in zip(first, second):
        assert scaled_err(a, b) < 1e-6


@pytest.mark.parametrize("backend", ["triton"])  # the token-terms ops: the fused token-level path
def test_opcheck_loss_ops(backend):
    (hidden, weight, bias, ids), (mask, adv, old, ref) = problem(B=2, T=2, D=4, V=5)
    params = GRPOParams(beta=0.04, entropy_coef=0.01)
    inputs = LossInputs(mask, adv.reshape(-1, 1), old, ref, None, None)
    grpo = _terms_args(inputs, params)
    h = leaf(hidden.reshape(-1, 4))
    fused = True
    ops = custom_ops.OPS
    _opcheck(ops.linear_grpo_terms.default,
             ops.linear_grpo_terms.args(h, leaf(weight), leaf(bias), ids.reshape(-1), 1.0, None,
                                        backend, *grpo), fused)
    logits = leaf(hidden @ weight.T)
    _opcheck(ops.logits_grpo_terms.default,
             ops.logits_grpo_terms.args(logits, ids.reshape(-1), 1.0, backend, False, *grpo),
             fused)


def test_reference_and_unfused_paths_compile_with_in_graph_checks():
    """Code traced around the ops (the reference; the sequence-level path) checks token ids
    and advantages with in-graph assertions instead of a host read (no graph break)."""
    from grpo_kernels import reference

    head, (mask, adv, old, ref) = problem(seed=4)
    hidden, weight, bias, ids = head

    def ref_step(h, i, a):
        return reference.fused_linear_grpo_loss(h, weight, i, a, mask, old, ref, bias,
                                                beta=0.04)[0]

    def seq_step(h, i, a):
        return gk.fused_linear_grpo_loss(h, weight, i, a, mask, old, ref, bias, beta=0.04,
                                         importance_sampling_level="sequence")[0]

    for step in (ref_step, seq_step):
        fn = torch.compile(step, fullgraph=True, backend="eager")
        assert torch.equal(fn(hidden, ids, adv), step(hidden, ids, adv))
        with pytest.raises(RuntimeError, match="advantages contain NaN"):
            fn(hidden, ids, adv * float("nan"))
    with pytest.raises(RuntimeError, match="completion_ids has a token id outside"):
        torch.compile(ref_step, fullgraph=True, backend="eager")(hidden, ids + 37, adv)


# ---- the three-pass route in a compiled graph ---------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_three_pass_route_compiles_and_matches_eager(backend, compiler, caplog, monkeypatch):
    """With a gradient at token level a compiled step takes the three-pass route too (the
    operator grpo_kernels::linear_grpo_loss_grad), and gives the eager call's loss, metrics and
    gradients; the route is logged while tracing, outside the graph."""
    import logging

    from grpo_kernels.ops import route

    head, grpo = problem(seed=7)
    with gk.force_backend(backend), caplog.at_level(logging.INFO, logger="grpo_kernels"):
        want = run(linear_step, None, head, grpo)
        monkeypatch.setattr(route, "_LOGGED", set())
        caplog.clear()
        ours = run(linear_step, compiler, head, grpo)
    assert_same(ours, want, exact=compiler == "eager")
    assert any("three-pass route" in r.getMessage() for r in caplog.records)


def test_opcheck_three_pass_op():
    (hidden, weight, bias, ids), (mask, adv, old, ref) = problem(B=2, T=2, D=4, V=5)
    params = GRPOParams(beta=0.04, entropy_coef=0.01)
    inputs = LossInputs(mask, adv.reshape(-1, 1), old, ref, None, None)
    g_ent = torch.full((4,), -0.01 / 4)
    for backend in BACKENDS:
        _opcheck(LOSS_GRAD_OP.default,
                 LOSS_GRAD_OP.args(leaf(hidden.reshape(-1, 4)), leaf(weight), leaf(bias),
                                   ids.reshape(-1), g_ent, 1.0, backend, [True, True, True],
                                   True, *_terms_args(inputs, params)))


FRESH = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
import torch, grpo_kernels as gk
torch.manual_seed(0)
h = torch.randn(2, 5, 8, requires_grad=True)
lm_head = torch.nn.Linear(8, 37, bias=False)  # an nn.Parameter head, as every model's
ids, adv = torch.randint(0, 37, (2, 5)), torch.randn(2)
def step(h, w):
    return gk.fused_linear_grpo_loss(h, w, ids, adv, beta=0.0, entropy_coef=0.01)[0]
with gk.force_backend(sys.argv[1]):
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(h, lm_head.weight)
    loss.backward()
    want = step(h.detach().requires_grad_(), lm_head.weight)
    with torch.no_grad():  # scoring: Triton's forward-only route, the chunked four-pass one
        scored = torch.compile(step, fullgraph=True, backend="aot_eager")(h, lm_head.weight)
print("SCORED", float(scored), float(want))
print("LOSS", float(loss), float(want))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compile_in_a_fresh_process(backend, tmp_path):
    """A fresh process compiles the fused loss with fullgraph=True before any eager call (no
    logger call inside the trace), takes the three-pass route and says so once; compiled under
    torch.no_grad() it takes the forward-only route on Triton (the four-pass one on the chunked
    backend) and gives the same loss."""
    import subprocess
    import sys

    script = tmp_path / "fresh.py"
    script.write_text(FRESH)
    proc = subprocess.run([sys.executable, str(script), backend], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    routes = [line for line in lines if "linear-head loss on the" in line]
    scoring = "forward-only route" if backend == "triton" else "four-pass route"
    assert len(routes) == 2 and "three-pass route" in routes[0], lines
    assert scoring in routes[1] and "grad mode is off" in routes[1], lines
    for line in lines[-2:]:
        loss, want = (float(x) for x in line.split()[1:])
        assert abs(loss - want) <= 1e-6 * (1 + abs(want))
