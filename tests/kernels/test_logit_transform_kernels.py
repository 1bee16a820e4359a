"""The Triton kernels with the logit transform (softcap, logit_scale; kernels/logit_transform.py),
through their launchers (the interpreter on CPU): forward with and without vocabulary splits,
both linear-head backwards (atomic; d-logits + GEMMs in both orientations and several chunks),
the logits-input kernels (in place too), against a float64 PyTorch truth. Errors are bounded by
twice PyTorch's own float32 error against that truth plus a small tolerance; every case also
checks that the transform changed the numbers."""

import pytest
import torch
from helpers import make_head, max_err, transformed_head

from grpo_kernels.compile_check import kernel_variants, row_variants
from grpo_kernels.kernels import linear_backward_atomic as atomic
from grpo_kernels.kernels import linear_backward_gemm as gemm
from grpo_kernels.kernels import linear_logprobs as lin
from grpo_kernels.kernels import logits_logprobs as lgt
from grpo_kernels.kernels.logit_transform import logit_transform_args

CAP = 3.0
# (softcap, logit_scale); the last: a negative scale, so masked columns would turn into +inf
# if the mask were applied before the transform
TRANSFORMS = [(CAP, None), (None, 0.4), (CAP, 1.6), (None, -1.3)]
TOL = 2e-5


def _problem(seed=3, N=37, D=40, V=75, dtype=torch.float32):
    """N = 37 tokens (3 token blocks of 16), V = 75 (3 vocabulary tiles of 32, the last partial),
    raw logits of spread ~2C: the cap is partly saturated."""
    hidden, weight, bias, ids = make_head(1, N, D, V, dtype, "cpu", seed=seed, bias=True,
                                          scale=2 * CAP)
    g = torch.Generator().manual_seed(seed + 1)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    g_logp[5] = g_ent[5] = 0.0  # a token without gradient
    return hidden[0], weight, bias, ids[0], g_logp, g_ent


def _bound(name, ours, same, truth):
    scale = max(1.0, truth.abs().max().item())
    assert max_err(ours, truth) <= 2 * max_err(same, truth) + TOL * scale, (
        f"{name}: ours {max_err(ours, truth):.3g} vs torch {max_err(same, truth):.3g}")


def _changed(a, b, name):
    assert max_err(a, b) > 1e-2 * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("softcap,logit_scale", TRANSFORMS)
def test_linear_forward_and_both_backwards(softcap, logit_scale):
    h, w, b, ids, g, gh = _problem()
    tr = dict(softcap=softcap, logit_scale=logit_scale)
    truth = transformed_head((h, w, b), ids, 0.8, softcap, logit_scale, g, gh)
    same = transformed_head((h, w, b), ids, 0.8, softcap, logit_scale, g, gh, torch.float32)
    plain = transformed_head((h, w, b), ids, 0.8, None, None, g, gh)
    for splits in (1, 3):
        logp, ent, lse = lin.linear_logprob_forward(h, w, b, ids, 0.8, splits=splits, **tr)
        for name, o, s, t, p in zip(("logp", "entropy", "lse"), (logp, ent, lse), same[:3],
                                    truth[:3], plain[:3]):
            _bound(f"{name} (splits={splits})", o, s, t)
            _changed(t, p, name)
    backwards = {
        "atomic": lambda: atomic.linear_logprob_backward_atomic(h, w, b, ids, lse, ent, g, gh, 0.8,
                                                                **tr),
        # 3 token chunks (by tokens) or 3 vocabulary chunks: the float32 accumulation
        "tokens": lambda: gemm.linear_logprob_backward_gemm(
            h, w, b, ids, lse, ent, g, gh, 0.8, buffer_bytes=16 * 75 * 4,
            orientation="tokens", **tr),
        "vocab": lambda: gemm.linear_logprob_backward_gemm(
            h, w, b, ids, lse, ent, g, gh, 0.8, buffer_bytes=37 * 32 * 4,
            orientation="vocab", **tr),
    }
    for kind, run in backwards.items():
        grads = run()
        for name, o, s, t, p in zip(("d hidden", "d weight", "d bias"), grads, same[3],
                                    truth[3], plain[3]):
            _bound(f"{kind} {name}", o, s, t)
            _changed(t, p, name)
        assert not grads[0][5].any()  # the token without gradient


@pytest.mark.parametrize("backward", ["atomic", "gemm"])
def test_backward_without_entropy_grad_and_partial_needs(backward):
    """g_ent None (log-probs only) and gradients of one input at a time, with a soft cap."""
    h, w, b, ids, g, _ = _problem(seed=4)
    tr = dict(softcap=CAP, logit_scale=0.7)
    truth = transformed_head((h, w, b), ids, 1.0, CAP, 0.7, g, None)
    _, ent, lse = lin.linear_logprob_forward(h, w, b, ids, 1.0, **tr)
    fn = atomic.linear_logprob_backward_atomic if backward == "atomic" else (
        gemm.linear_logprob_backward_gemm)
    for needs in ((True, False, False), (False, True, True)):
        grads = fn(h, w, b, ids, lse, ent, g, None, 1.0, needs=needs, **tr)
        for got, want, need in zip(grads, truth[3], needs):
            assert (got is None) == (not need)
            if need:
                assert max_err(got, want) < TOL * max(1.0, want.abs().max().item())


def test_bf16_head_with_cap():
    """16-bit inputs: within twice PyTorch's bf16 error (bf16 logits, float32 transform)."""
    h, w, b, ids, g, gh = _problem(seed=6, dtype=torch.bfloat16)
    truth = transformed_head((h, w, b), ids, 0.7, CAP, None, g, gh)
    same = transformed_head((h, w, b), ids, 0.7, CAP, None, g, gh, torch.bfloat16)
    logp, ent, lse = lin.linear_logprob_forward(h, w, b, ids, 0.7, softcap=CAP)
    grads = gemm.linear_logprob_backward_gemm(h, w, b, ids, lse, ent, g, gh, 0.7, softcap=CAP)
    for name, o, s, t in zip(("logp", "entropy", "d hidden", "d weight", "d bias"),
                             (logp, ent, *grads), (*same[:2], *same[3]),
                             (*truth[:2], *truth[3])):
        scale = max(1.0, t.abs().max().item())
        assert max_err(o, t) <= 2 * max_err(s, t) + 1e-2 * scale, name


def test_grad_filter_threshold_follows_the_logit_scale():
    """grad_filter's eps is relative to the token's largest d logit, which a logit scale s
    multiplies by |s|: with eps = 0 the filtered backward is the exact one, and an eps that
    drops every tile of the unscaled problem drops every tile of the scaled one too."""
    h, w, b, ids, g, _ = _problem(seed=7)
    for s in (0.05, 20.0):
        _, ent, lse = lin.linear_logprob_forward(h, w, b, ids, 1.0, logit_scale=s)

        def run(eps, lse=lse, ent=ent, s=s):
            return atomic.linear_logprob_backward_atomic(h, w, b, ids, lse, ent, g, None, 1.0,
                                               logit_scale=s, grad_filter=eps)

        exact = run(None)
        assert all(torch.equal(x, y) for x, y in zip(exact, run(0.0)))
        # |d logits| = |s|·|g|·|onehot - p| <= |s|·|g| < 2·|s|·|g|: every tile is dropped
        assert all(not x.any() for x in run(2.0))
        kept = run(1e-3)
        assert max_err(kept[0], exact[0]) < 0.05 * exact[0].abs().max().item()


@pytest.mark.parametrize("softcap,logit_scale", TRANSFORMS)
@pytest.mark.parametrize("inplace", [False, True])
def test_logits_kernels(softcap, logit_scale, inplace):
    """Raw logits [B, T, V] with V = 75 (a partial 64-wide tile: masked columns)."""
    h, w, b, ids, g, gh = _problem(seed=8)
    x = (h @ w.T + b).reshape(1, 37, 75)
    tr = dict(softcap=softcap, logit_scale=logit_scale)
    ident = lambda y: y  # noqa: E731
    truth = transformed_head((x[0],), ids, 0.9, softcap, logit_scale, g, gh, raw=ident)
    same = transformed_head((x[0],), ids, 0.9, softcap, logit_scale, g, gh, torch.float32,
                            raw=ident)
    logp, ent, lse = lgt.logits_logprob_forward(x, ids, 0.9, **tr)
    dx = lgt.logits_logprob_backward(x, ids, lse, ent, g, gh, 0.9, **tr)
    if inplace:
        buf = x.clone()
        lgt.logits_logprob_backward(buf, ids, lse, ent, g, gh, 0.9, out=buf, **tr)
        assert torch.equal(buf, dx)
    for name, o, s, t in zip(("logp", "entropy", "lse", "d logits"), (logp, ent, lse, dx[0]),
                             (*same[:3], same[3][0]), (*truth[:3], truth[3][0])):
        _bound(name, o, s, t)
    _changed(truth[3][0], transformed_head((x[0],), ids, 0.9, None, None, g, gh,
                                           raw=ident)[3][0], "d logits")


def test_transform_args_and_plain_variants():
    """No transform: both flags off (the plain kernels); a cap carries the scale in logit_mul."""
    assert logit_transform_args(None, None) == dict(logit_mul=1.0, softcap=1.0,
                                                    HAS_SCALE=False, HAS_SOFTCAP=False)
    assert logit_transform_args(None, -2.0)["HAS_SCALE"]
    capped = logit_transform_args(30.0, 0.5)
    assert capped["HAS_SOFTCAP"] and not capped["HAS_SCALE"]
    assert capped["logit_mul"] == 0.5 / 30.0 and capped["softcap"] == 30.0


def test_compile_check_lists_the_transform_variants():
    """Every kernel that takes the transform has scale and softcap variants to compile, also
    with --quick (CI), and the variants without a transform keep their names. (The variants'
    compile is tests/kernels/test_compile_check.py's, outside the interpreter.)"""
    kv = kernel_variants
    for quick in (True, False):
        names = [v.name for v in kv._linear(90, 4096, 896, 151936, torch.bfloat16,
                                            torch.bfloat16, "tf32", quick, {"fwd"})]
        names += [v.name for v in row_variants.logits_variants(90, 151936, torch.bfloat16, quick)]
        for kind in ("linear_fwd", "linear_bwd", "linear_dz", "logits_fwd", "logits_bwd"):
            for tag in ("logit=scale", "logit=softcap"):
                assert any(n.startswith(kind + "[") and tag in n for n in names), (kind, tag)
            assert any(n.startswith(kind + "[") and "logit=" not in n for n in names)
