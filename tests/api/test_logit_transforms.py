"""softcap and logit_scale (final-logit soft-capping, a logit scale) through the functional API:
log-probs, entropy and gradients against a float64 truth on both backends, the fused GRPO loss,
the logits entry points, the modules and the argument checks.

The transform is z = softcap·tanh(logit_scale·y / softcap), then z / temperature. The data make
the raw logits about as large as the cap (spread ~C), so tanh is partly saturated: each test also
checks that the transform changed the result, so that it could not pass without one."""

import math
import re

import pytest
import torch
from helpers import leaf, make_grpo_batch, make_head, max_err

import grpo_kernels as gk
from grpo_kernels import reference

BACKENDS = ["triton", "chunked"]
CAP = 4.0
# (softcap, logit_scale): a cap alone (Gemma 2), a scale alone (Cohere), both (scale first),
# and a negative scale with a cap
TRANSFORMS = [(CAP, None), (None, 0.35), (CAP, 1.7), (CAP, -0.8)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
NAMES = ["logp", "entropy", "d hidden", "d weight", "d bias"]


def _head(dtype=torch.float32, seed=11, B=2, T=9, D=24, V=70):
    """Raw logits of spread ~C·1.5: a good share of them beyond the cap's linear range."""
    return make_head(B, T, D, V, dtype, "cpu", seed=seed, bias=True, scale=1.5 * CAP)


def _batch(hidden, weight, bias, ids, seed, temperature=1.0, **transform):
    """make_grpo_batch, with old/ref log-probs near the transformed policy's (ratios near 1)."""
    mask, adv, old, ref = make_grpo_batch(hidden, weight, bias, ids, seed=seed,
                                          temperature=temperature)
    args = (hidden.double(), weight.double(), ids, bias.double())
    shift = (reference.selective_logprobs(*args, temperature=temperature, **transform)
             - reference.selective_logprobs(*args, temperature=temperature)).float()
    return mask, adv, old + shift, ref + shift


def _selective(fn, hidden, weight, bias, ids, coef, **kw):
    """logp, entropy and the gradients of Σ c0·logp + Σ c1·H w.r.t. hidden, weight, bias."""
    h, w, b = leaf(hidden), leaf(weight), leaf(bias)
    logp, ent = fn(h, w, ids, b, return_entropy=True, **kw)
    ((coef[0] * logp).sum() + (coef[1] * ent).sum()).backward()
    return [logp.detach(), ent.detach(), h.grad, w.grad, b.grad]


def _check(ours, same, truth, dtype, names=NAMES):
    """ours within twice PyTorch's own same-dtype error against float64, plus a tolerance."""
    for name, o, s, t in zip(names, ours, same, truth):
        scale = max(1.0, t.abs().max().item())
        assert max_err(o, t) <= 2 * max_err(s, t) + TOL[dtype] * scale, (
            f"{name}: ours {max_err(o, t):.3g} vs torch {max_err(s, t):.3g}")


def _differs(a, b, name):
    """The transform must change the result well beyond rounding (a test that can fail)."""
    assert max_err(a, b) > 1e-2 * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("softcap,logit_scale", TRANSFORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_logprobs_match_float64_truth(backend, dtype, softcap, logit_scale):
    if dtype == torch.bfloat16 and logit_scale is not None and logit_scale < 0:
        pytest.skip("bf16 runs the two common transforms only (CI time)")
    hidden, weight, bias, ids = _head()
    coef = torch.randn(2, *ids.shape, generator=torch.Generator().manual_seed(3))
    kw = dict(temperature=0.7, softcap=softcap, logit_scale=logit_scale)
    d = lambda x: x.double()  # noqa: E731
    truth = _selective(reference.selective_logprobs, d(hidden), d(weight), d(bias), ids,
                       coef.double(), **kw)
    cast = [x.to(dtype) for x in (hidden, weight, bias)]
    same = _selective(reference.selective_logprobs, *cast, ids, coef, **kw)
    with gk.force_backend(backend):
        ours = _selective(gk.selective_logprobs, *cast, ids, coef, **kw)
    _check(ours, same, truth, dtype)
    for o, dt in zip(ours, [torch.float32] * 2 + [dtype] * 3):
        assert o.dtype == dt
    plain = _selective(reference.selective_logprobs, d(hidden), d(weight), d(bias), ids,
                       coef.double(), temperature=0.7)
    for name, t, p in zip(NAMES, truth, plain):
        _differs(t, p, name)


def test_cap_saturates_and_order_is_scale_cap_temperature():
    """The math itself, on the reference and both backends: capped logits stay within ±C
    (entropy near log V when C/τ is small), and z = C·tanh(s·y/C) / τ, not C·tanh(s·y/(C·τ))."""
    hidden, weight, bias, ids = _head(V=50)
    y = (hidden @ weight.T + bias).double()
    assert (y.abs() > 2 * CAP).float().mean() > 0.1  # a good share saturates
    z = CAP * torch.tanh(1.7 * y / CAP) / 0.5
    want = torch.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
    for backend in BACKENDS:
        with gk.force_backend(backend):
            got = gk.selective_logprobs(hidden, weight, ids, bias, temperature=0.5, softcap=CAP,
                                        logit_scale=1.7)
        assert max_err(got, want) < 1e-4, backend
        assert (got >= -2 * CAP / 0.5 - math.log(50)).all()  # |z| <= C/τ bounds logp
    wrong = torch.log_softmax(CAP * torch.tanh(1.7 * y / (CAP * 0.5)), -1)
    _differs(want, wrong.gather(-1, ids[..., None]).squeeze(-1), "order")


@pytest.mark.parametrize("softcap,logit_scale", [(CAP, None), (CAP, 1.7)])
@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_grpo_loss_matches_reference(backend, loss_type, level, softcap,
                                                  logit_scale):
    """The GRPO loss through fused_linear_grpo_loss (on Triton at token level: the token-terms
    op with the epilogue in the forward kernel) against the float64 reference: loss, metrics and
    the gradients of hidden, weight and bias."""
    hidden, weight, bias, ids = _head(seed=5)
    mask, adv, old, ref = _batch(hidden, weight, bias, ids, 5, 0.8, softcap=softcap,
                                 logit_scale=logit_scale)
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
              temperature=0.8, entropy_coef=0.01, softcap=softcap, logit_scale=logit_scale)

    def run(fn, dtype, **extra):
        h, w, b = (leaf(x, dtype) for x in (hidden, weight, bias))
        loss, metrics = fn(h, w, ids, adv.to(dtype), mask, old.to(dtype), ref.to(dtype), b,
                           **{**kw, **extra})
        loss.backward()
        return [loss.detach(), h.grad, w.grad, b.grad], metrics

    truth, m_truth = run(reference.fused_linear_grpo_loss, torch.float64)
    same, _ = run(reference.fused_linear_grpo_loss, torch.float32)
    with gk.force_backend(backend):
        ours, m_ours = run(gk.fused_linear_grpo_loss, torch.float32)
    _check(ours, same, truth, torch.float32, ["loss", "d hidden", "d weight", "d bias"])
    for key in ("entropy", "kl"):
        assert abs(m_ours[key].item() - m_truth[key].item()) < 1e-4, key
    plain, _ = run(reference.fused_linear_grpo_loss, torch.float64, softcap=None,
                   logit_scale=None)
    for name, t, p in zip(["loss", "d hidden", "d weight", "d bias"], truth, plain):
        _differs(t, p, name)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_entry_points_transform_raw_logits(backend, inplace):
    """logprobs_from_logits and grpo_loss apply the transform to the raw logits they get: the
    same numbers (and d logits) as the linear head with the same transform."""
    hidden, weight, bias, ids = _head(seed=8)
    raw = hidden @ weight.T + bias
    coef = torch.randn(2, *ids.shape, generator=torch.Generator().manual_seed(4))
    kw = dict(temperature=0.9, softcap=CAP, logit_scale=0.6)
    x64 = leaf(raw.double())
    lp, en = reference.logprobs_from_logits(x64, ids, return_entropy=True, **kw)
    ((coef[0] * lp).sum() + (coef[1] * en).sum()).backward()
    with gk.force_backend(backend):
        x = leaf(raw)
        y = x * 1.0  # in place: the op overwrites its input, not the leaf
        logp, ent = gk.logprobs_from_logits(y, ids, return_entropy=True, inplace=inplace, **kw)
        ((coef[0] * logp).sum() + (coef[1] * ent).sum()).backward()
    assert max_err(logp, lp) < 2e-5 and max_err(ent, en) < 2e-5
    assert max_err(x.grad, x64.grad) < 2e-5 * max(1.0, x64.grad.abs().max().item())
    _differs(lp, reference.logprobs_from_logits(raw.double(), ids, temperature=0.9), "logp")

    mask, adv, old, ref = _batch(hidden, weight, bias, ids, 8, 0.9, softcap=CAP, logit_scale=0.6)
    loss_kw = dict(beta=0.04, loss_type="dapo", temperature=0.9, softcap=CAP, logit_scale=0.6)
    want, _ = reference.grpo_loss(raw.double(), ids, adv, mask, old, ref, **loss_kw)
    with gk.force_backend(backend):
        got, _ = gk.grpo_loss(raw.clone(), ids, adv, mask, old, ref, inplace=inplace, **loss_kw)
        module = gk.GRPOLoss(beta=0.04, temperature=0.9, softcap=CAP, logit_scale=0.6)
        by_module, _ = module(raw.clone(), ids, adv, mask, old, ref)
    assert abs(got.item() - want.item()) < 1e-5 * max(1.0, abs(want.item()))
    assert abs(by_module.item() - want.item()) < 1e-5 * max(1.0, abs(want.item()))
    assert "softcap=4.0" in repr(module)


def test_module_passes_the_transform():
    hidden, weight, bias, ids = _head(seed=9)
    mask, adv, old, _ = _batch(hidden, weight, bias, ids, 9, softcap=CAP)
    module = gk.FusedLinearGRPOLoss(loss_type="grpo", softcap=CAP)
    got, _ = module(hidden, weight, ids, adv, mask, old, bias=bias)
    want, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old, None, bias,
                                        loss_type="grpo", softcap=CAP)
    plain, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old, None, bias,
                                         loss_type="grpo")
    assert torch.equal(got, want) and not torch.equal(got, plain)


def test_no_transform_is_bitwise_the_plain_call():
    """softcap=None, logit_scale=None is the call without them, on both backends."""
    hidden, weight, bias, ids = _head(seed=12)
    for backend in BACKENDS:
        with gk.force_backend(backend):
            a = gk.selective_logprobs(hidden, weight, ids, bias, temperature=0.7,
                                      return_entropy=True)
            b = gk.selective_logprobs(hidden, weight, ids, bias, temperature=0.7,
                                      return_entropy=True, softcap=None, logit_scale=None)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


BAD = [
    (dict(softcap=0.0), ValueError, "softcap must be > 0"),
    (dict(softcap=-30.0), ValueError, "softcap must be > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
    (dict(softcap=float("nan")), ValueError, "softcap must be finite"),
    (dict(softcap="30"), TypeError, "softcap must be a float or None"),
    (dict(softcap=True), TypeError, "softcap must be a float or None"),
    (dict(softcap=torch.tensor(30.0)), TypeError, "softcap must be a float or None"),
    (dict(logit_scale=0.0), ValueError, "logit_scale must be non-zero"),
    (dict(logit_scale=0), ValueError, "logit_scale must be non-zero"),
    (dict(logit_scale=float("-inf")), ValueError, "logit_scale must be finite"),
    (dict(logit_scale=[0.5]), TypeError, "logit_scale must be a float or None"),
    (dict(softcap=1e39), ValueError, "softcap must be finite, and so in float32"),  # inf there
    (dict(logit_scale=-1e300), ValueError, "logit_scale must be finite, and so in float32"),
    (dict(softcap=1e-39), ValueError, "softcap must be > 0"),  # under float32's normal range
]


@pytest.mark.parametrize("kw,error,match", BAD, ids=[f"{k}" for k, *_ in BAD])
def test_bad_arguments_are_refused_with_their_name(kw, error, match):
    hidden, weight, bias, ids = _head(seed=1, T=3, V=20)
    mask, adv, old, _ = make_grpo_batch(hidden, weight, bias, ids, seed=1)
    calls = [
        lambda: gk.selective_logprobs(hidden, weight, ids, bias, **kw),
        lambda: gk.logprobs_from_logits(hidden @ weight.T, ids, **kw),
        lambda: gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, **kw),
        lambda: gk.grpo_loss(hidden @ weight.T, ids, adv, mask, **kw),
        lambda: gk.FusedLinearGRPOLoss(**kw),
        lambda: gk.GRPOLoss(**kw),
        lambda: reference.selective_logprobs(hidden, weight, ids, bias, **kw),
        lambda: reference.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, **kw),
    ]
    for call in calls:
        with pytest.raises(error, match=match):
            call()


FACTORS = [  # each within float32's range, but a factor the kernels apply is not
    (dict(softcap=3e38), "1 / softcap"),  # Triton: uniform log-probs; chunked: NaN
    (dict(logit_scale=3e38), "|logit_scale| / temperature"),  # chunked: failed converting it
    (dict(softcap=30.0, temperature=1e-37), "softcap / temperature"),
]


@pytest.mark.parametrize("kw,factor", FACTORS, ids=[f for _, f in FACTORS])
def test_a_transform_factor_outside_float32_is_refused(kw, factor):
    hidden, weight, bias, ids = _head(seed=1, T=3, V=20)
    mask, adv, _, _ = make_grpo_batch(hidden, weight, bias, ids, seed=1)
    module_kw = {k: v for k, v in kw.items() if k != "temperature"}
    calls = [
        lambda: gk.selective_logprobs(hidden, weight, ids, bias, **kw),
        lambda: gk.logprobs_from_logits(hidden @ weight.T, ids, **kw),
        lambda: gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, **kw),
        lambda: gk.grpo_loss(hidden @ weight.T, ids, adv, mask, **kw),
        lambda: gk.FusedLinearGRPOLoss(**module_kw, temperature=kw.get("temperature", 1.0))(
            hidden, weight, ids, adv, mask),
        lambda: reference.selective_logprobs(hidden, weight, ids, bias, **kw),
        lambda: reference.logprobs_from_logits(hidden @ weight.T, ids, **kw),
        lambda: reference.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, **kw),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=f"factor {re.escape(factor)} = "):
            call()


def test_good_arguments_are_accepted_as_floats():
    hidden, weight, bias, ids = _head(seed=2, T=3, V=20)
    a = gk.selective_logprobs(hidden, weight, ids, bias, softcap=30, logit_scale=-2)
    b = gk.selective_logprobs(hidden, weight, ids, bias, softcap=30.0, logit_scale=-2.0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ops_take_the_transform(backend):
    """The operators' schema, fake tensors and autograd registration with the transform as
    their trailing (defaulted) arguments; the token-terms op on Triton (the fused path)."""
    from grpo_kernels.loss_call import terms_args as _terms_args
    from grpo_kernels.ops.custom_ops import OPS
    from grpo_kernels.params import GRPOParams
    from grpo_kernels.validation import LossInputs

    hidden, weight, bias, ids = _head(seed=13, B=1, T=3, D=4, V=5)
    h, w, b = leaf(hidden[0]), leaf(weight), leaf(bias)
    tests = ["test_schema", "test_faketensor", "test_autograd_registration",
             "test_aot_dispatch_dynamic"]
    # .args: the hyperparameters as the operators take them (0-d tensors)
    cases = [(OPS.linear_logprobs,
              (h, w, b, ids[0], 0.7, None, backend, "targets", CAP, 0.5)),
             (OPS.logits_logprobs,
              (leaf(hidden @ weight.T), ids[0], 0.7, backend, "targets", False, CAP, None))]
    if backend == "triton":
        mask, adv, old, ref = _batch(hidden, weight, bias, ids, 13, softcap=CAP)
        params = GRPOParams(beta=0.04, entropy_coef=0.01)
        grpo = _terms_args(LossInputs(mask, adv.reshape(-1, 1), old, ref, None, None), params)
        cases.append((OPS.linear_grpo_terms,
                      (h, w, b, ids[0], 1.0, None, backend, *grpo, CAP, None)))
    for op, args in cases:
        result = torch.library.opcheck(op.default, op.args(*args), test_utils=tests)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_compiled_loss_with_cap_matches_eager():
    """torch.compile(fullgraph=True) of the fused loss with a soft cap: the ops take it as a
    0-d tensor argument (chunked backend: no interpreter inside the graph)."""
    hidden, weight, bias, ids = _head(seed=14)
    mask, adv, old, _ = _batch(hidden, weight, bias, ids, 14, softcap=CAP)

    def loss_fn(h, w, b):
        return gk.fused_linear_grpo_loss(h, w, ids, adv, mask, old, None, b, softcap=CAP,
                                         logit_scale=0.8)[0]

    with gk.force_backend("chunked"):
        eager = loss_fn(hidden, weight, bias)
        compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(hidden, weight,
                                                                               bias)
    assert abs(eager.item() - compiled.item()) < 1e-6 * max(1.0, abs(eager.item()))
