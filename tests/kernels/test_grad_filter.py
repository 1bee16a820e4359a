"""Gradient filtering (opt-in `grad_filter`): the Triton backward skips a [tokens × vocabulary]
tile when every d logit in it is <= eps × its token's gradient scale (|g_logp| + |g_entropy|) / τ.

The truth here is built in float64 from the definition: full d logits, the kernel's tile grid,
dropped tiles zeroed, then the three products. It is checked on both sides: tiles that must be
kept change the gradient, tiles that must be dropped contribute exactly nothing."""

import pytest
import torch
from helpers import hyper, leaf, make_grpo_batch, make_head, max_err

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels import tile_configs
from grpo_kernels.validation import check_grad_filter

# 4 token blocks × 10 vocabulary tiles in the interpreter's tiles (BLOCK_N=16, BLOCK_V=32)
B, T, D, V = 2, 29, 24, 300


def _inputs(seed=0, temperature=0.8):
    hidden, weight, bias, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=seed, bias=True,
                                          scale=3.0)
    bias = bias.clone()
    bias[96:] -= 9.0  # vocabulary tiles 3..9 hold little probability: filtering drops them
    ids = ids % 96  # targets live in tiles 0..2
    g = torch.Generator().manual_seed(seed + 5)
    coef = torch.randn(2, B, T, generator=g)
    coef[:, 1, 20:] = 0.0  # a masked tail: rows without gradient
    return hidden, weight, bias, ids, coef, temperature


def _kernel_grads(hidden, weight, bias, ids, coef, temperature, grad_filter):
    h, w, b = leaf(hidden), leaf(weight), leaf(bias)
    with gk.force_backend("triton"):
        logp, ent = gk.selective_logprobs(h, w, ids, b, temperature=temperature,
                                          return_entropy=True, grad_filter=grad_filter)
    ((coef[0] * logp).sum() + (coef[1] * ent).sum()).backward()
    return h.grad, w.grad, b.grad


def _filtered_truth(hidden, weight, bias, ids, coef, temperature, eps, margin=1e-3):
    """float64 gradients with the kernel's dropped tiles zeroed; also the kept-tile mask and
    whether any tile sits within `margin` (relative) of its threshold (an ambiguous decision)."""
    h, w, b = hidden.double().reshape(-1, D), weight.double(), bias.double()
    g, gh = coef[0].double().reshape(-1), coef[1].double().reshape(-1)
    z = (h @ w.T + b) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    H = -(p * log_p).sum(-1)
    onehot = torch.nn.functional.one_hot(ids.reshape(-1), V).double()
    dz = (g[:, None] * (onehot - p) - gh[:, None] * p * (log_p + H[:, None])) / temperature
    thr = eps * (g.abs() + gh.abs()) / temperature
    cfg = tile_configs.linear_bwd_atomic(torch.float32, torch.device("cpu"))
    BN, BV = cfg["BLOCK_N"], cfg["BLOCK_V"]
    N = dz.shape[0]
    keep = torch.zeros(-(-N // BN), -(-V // BV), dtype=torch.bool)
    ambiguous = False
    for i in range(keep.shape[0]):
        for j in range(keep.shape[1]):
            tile = dz[i * BN:(i + 1) * BN, j * BV:(j + 1) * BV].abs()
            t = thr[i * BN:(i + 1) * BN, None]
            hi = bool((tile > t * (1 - margin)).any())
            lo = bool((tile > t * (1 + margin)).any())
            keep[i, j] = lo
            ambiguous |= hi != lo
            if not lo:
                dz[i * BN:(i + 1) * BN, j * BV:(j + 1) * BV] = 0.0
    grads = ((dz @ w).reshape(B, T, D), dz.T @ h, dz.sum(0))
    return grads, keep, ambiguous


@pytest.mark.parametrize("eps", [1e-4, 1e-2])
def test_filtered_gradients_match_the_tile_definition(eps):
    inputs = _inputs()
    truth, keep, ambiguous = _filtered_truth(*inputs, eps)
    assert not ambiguous, "a tile sits on its threshold; pick another seed"
    assert 0 < int(keep.sum()) < keep.numel(), keep  # the case really drops some tiles
    exact = _kernel_grads(*inputs, None)
    filtered = _kernel_grads(*inputs, eps)
    for name, f, t, e in zip(("hidden", "weight", "bias"), filtered, truth, exact):
        scale = t.abs().max().item()
        assert max_err(f, t) <= 2e-5 * scale, name
        assert max_err(f, e) > 0.0, name  # filtering changed something
    # vocabulary tiles dropped for every token block receive exactly nothing
    BV = tile_configs.linear_bwd_atomic(torch.float32, torch.device("cpu"))["BLOCK_V"]
    for j in torch.nonzero(~keep.any(0)).flatten().tolist():
        assert torch.all(filtered[1][j * BV:(j + 1) * BV] == 0)
        assert torch.all(filtered[2][j * BV:(j + 1) * BV] == 0)
        assert torch.any(exact[2][j * BV:(j + 1) * BV] != 0)


def test_zero_eps_is_exact_and_other_backends_ignore_the_filter():
    """eps = 0 drops only all-zero tiles, so it must equal the exact backward bit for bit; the
    chunked PyTorch path (and the reference) are exact whatever grad_filter says."""
    inputs = _inputs(seed=1)
    for a, b in zip(_kernel_grads(*inputs, 0.0), _kernel_grads(*inputs, None)):
        assert torch.equal(a, b)
    hidden, weight, bias, ids, coef, temperature = inputs
    outs = []
    for gf in (None, 0.5):
        h = leaf(hidden)
        with gk.force_backend("chunked"):
            logp = gk.selective_logprobs(h, weight, ids, bias, temperature=temperature,
                                         grad_filter=gf)
        (coef[0] * logp).sum().backward()
        outs.append(h.grad)
    assert torch.equal(outs[0], outs[1])


def test_eps_one_drops_every_tile_of_the_fused_loss():
    """Positive control through the public loss and the module: without an entropy gradient
    every |d logit| < |g| / τ, so eps = 1 must drop every tile (all gradients exactly 0)."""
    hidden, weight, bias, ids = make_head(3, 17, 20, 123, torch.float32, "cpu", seed=2,
                                          bias=True)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, bias, ids)
    kw = hyper("dapo", "token", 0.04, 1.0, None)
    for gf in (None, 1.0):
        loss_fn = gk.FusedLinearGRPOLoss(**kw, grad_filter=gf)
        h, w, b = leaf(hidden), leaf(weight), leaf(bias)
        with gk.force_backend("triton"):
            loss, _ = loss_fn(h, w, ids, adv, mask, old, ref, b)
        loss.backward()
        zero = [bool(torch.all(x.grad == 0)) for x in (h, w, b)]
        assert zero == ([False] * 3 if gf is None else [True] * 3), (gf, zero)


def test_grad_filter_values_and_errors():
    assert check_grad_filter(None, torch.bfloat16) is None
    assert check_grad_filter("auto", torch.bfloat16) == 2.0 ** -12
    assert check_grad_filter("auto", torch.float16) == 2.0 ** -15
    assert check_grad_filter(0, torch.float32) == 0.0
    hidden, weight, _, ids = make_head(1, 3, 8, 11, torch.float32, "cpu")
    for bad in ("fast", -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="grad_filter must be"):
            gk.selective_logprobs(hidden, weight, ids, grad_filter=bad)
        with pytest.raises(ValueError, match="grad_filter must be"):
            gk.FusedLinearGRPOLoss(grad_filter=bad)
        with pytest.raises(ValueError, match="grad_filter must be"):
            reference.fused_linear_grpo_loss(hidden, weight, ids, torch.ones(1), grad_filter=bad)
