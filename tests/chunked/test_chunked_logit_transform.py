"""The chunked PyTorch launchers with the logit transform (softcap, logit_scale): a soft cap runs
`chunked/softcap.py`, a scale alone rides in the linear head's temperature (also when negative),
and the logits input takes either through `softcap.py`. Against a float64 PyTorch truth, with
several tiles (small chunk budgets), tokens without gradient, partial `needs`, 16-bit inputs
and the in-place logits backward."""

import pytest
import torch
from helpers import make_head, max_err, transformed_head

from grpo_kernels import chunked

CAP = 3.0
TRANSFORMS = [(CAP, None), (None, 0.4), (CAP, 1.6), (None, -1.3), (CAP, -0.9)]
TOL = 2e-5


def _problem(seed=3, N=29, D=20, V=61, dtype=torch.float32):
    hidden, weight, bias, ids = make_head(1, N, D, V, dtype, "cpu", seed=seed, bias=True,
                                          scale=2 * CAP)
    g = torch.Generator().manual_seed(seed + 1)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    g_logp[4] = g_ent[4] = 0.0  # a token without gradient: dropped before the tiles
    return hidden[0], weight, bias, ids[0], g_logp, g_ent


def _bound(name, ours, same, truth, tol=TOL):
    scale = max(1.0, truth.abs().max().item())
    assert max_err(ours, truth) <= 2 * max_err(same, truth) + tol * scale, (
        f"{name}: ours {max_err(ours, truth):.3g} vs torch {max_err(same, truth):.3g}")


def _changed(a, b, name):
    assert max_err(a, b) > 1e-2 * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("chunk_elements", [None, 8 * 16], ids=["one-tile", "tiles"])
@pytest.mark.parametrize("softcap,logit_scale", TRANSFORMS)
def test_linear_head(softcap, logit_scale, chunk_elements):
    h, w, b, ids, g, gh = _problem()
    tr = dict(softcap=softcap, logit_scale=logit_scale, chunk_elements=chunk_elements)
    truth = transformed_head((h, w, b), ids, 0.8, softcap, logit_scale, g, gh)
    same = transformed_head((h, w, b), ids, 0.8, softcap, logit_scale, g, gh, torch.float32)
    plain = transformed_head((h, w, b), ids, 0.8, None, None, g, gh)
    keep = {}
    logp, ent, lse = chunked.linear_logprob_forward(h, w, b, ids, 0.8, keep=keep, **tr)
    assert not keep or softcap is None  # a capped forward keeps no tile
    grads = chunked.linear_logprob_backward(h, w, b, ids, lse, ent, g, gh, 0.8, kept=keep, **tr)
    names = ("logp", "entropy", "lse", "d hidden", "d weight", "d bias")
    for name, o, s, t, p in zip(names, (logp, ent, lse, *grads), (*same[:3], *same[3]),
                                (*truth[:3], *truth[3]), (*plain[:3], *plain[3])):
        _bound(name, o, s, t)
        _changed(t, p, name)
    assert not grads[0][4].any()


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True)])
def test_capped_backward_partial_needs_without_entropy(needs):
    h, w, b, ids, g, _ = _problem(seed=5)
    truth = transformed_head((h, w, b), ids, 1.0, CAP, 0.5, g, None)
    _, ent, lse = chunked.linear_logprob_forward(h, w, b, ids, 1.0, softcap=CAP, logit_scale=0.5)
    grads = chunked.linear_logprob_backward(h, w, b, ids, lse, ent, g, None, 1.0, needs=needs,
                                            softcap=CAP, logit_scale=0.5, chunk_elements=64)
    for got, want, need in zip(grads, truth[3], needs):
        assert (got is None) == (not need)
        if need:
            assert max_err(got, want) < TOL * max(1.0, want.abs().max().item())


def test_capped_backward_of_masked_tokens_only_is_zero():
    h, w, b, ids, _, _ = _problem(seed=6)
    zeros = torch.zeros(h.shape[0])
    _, ent, lse = chunked.linear_logprob_forward(h, w, b, ids, 1.0, softcap=CAP)
    grads = chunked.linear_logprob_backward(h, w, b, ids, lse, ent, zeros, zeros, 1.0,
                                            softcap=CAP)
    assert all(x is not None and not x.any() for x in grads)


def test_bf16_mixed_head_with_cap():
    """bf16 hidden with a float32 head weight (mixed head precision): float32 logits."""
    h, w, b, ids, g, gh = _problem(seed=7)
    hb = h.bfloat16()
    truth = transformed_head((hb, w, b), ids, 0.7, CAP, None, g, gh)
    logp, ent, lse = chunked.linear_logprob_forward(hb, w, b, ids, 0.7, softcap=CAP)
    grads = chunked.linear_logprob_backward(hb, w, b, ids, lse, ent, g, gh, 0.7, softcap=CAP)
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    for name, o, t in zip(("logp", "entropy", "d hidden", "d weight", "d bias"),
                          (logp, ent, *grads), (*truth[:2], *truth[3])):
        tol = 1e-2 if name == "d hidden" else 1e-4  # d hidden is rounded to bf16
        assert max_err(o, t) < tol * max(1.0, t.abs().max().item()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap,logit_scale", TRANSFORMS)
def test_logits(softcap, logit_scale, dtype):
    """Raw logits [B, T, V] (B = 2 sequences, blocks of rows smaller than a sequence), the
    backward out of place and in place."""
    h, w, b, ids, g, gh = _problem(seed=8, N=30)
    x = (h @ w.T + b).to(dtype)
    ident = lambda y: y  # noqa: E731
    tr = dict(softcap=softcap, logit_scale=logit_scale, chunk_elements=4 * 61)
    truth = transformed_head((x,), ids, 0.9, softcap, logit_scale, g, gh, raw=ident)
    same = transformed_head((x,), ids, 0.9, softcap, logit_scale, g, gh, dtype, raw=ident)
    x3, ids2 = x.reshape(2, 15, 61), ids
    logp, ent, lse = chunked.logits_logprob_forward(x3, ids2, 0.9, **tr)
    dx = chunked.logits_logprob_backward(x3, ids2, lse, ent, g, gh, 0.9, **tr)
    buf = x3.clone()
    chunked.logits_logprob_backward(buf, ids2, lse, ent, g, gh, 0.9, out=buf, **tr)
    assert torch.equal(buf, dx) and dx.dtype == dtype
    tol = TOL if dtype == torch.float32 else 1e-2
    for name, o, s, t in zip(("logp", "entropy", "lse", "d logits"),
                             (logp, ent, lse, dx.reshape(30, 61)), (*same[:3], same[3][0]),
                             (*truth[:3], truth[3][0])):
        _bound(name, o, s, t, tol)
    _changed(truth[0], transformed_head((x,), ids, 0.9, None, None, g, gh, raw=ident)[0],
             "logp")
