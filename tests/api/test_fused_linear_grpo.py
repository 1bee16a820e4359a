"""fused_linear_grpo_loss against a float64 truth (the reference, in float64), on the Triton
kernels (interpreter on CPU) and the chunked PyTorch path: loss, metrics and gradients of hidden,
weight and bias, over loss type × importance-sampling level × beta × temperature × delta × bias,
with a fully masked row in every batch."""

import pytest
import torch
from helpers import (
    MATRIX,
    TYPE_LEVELS,
    hyper,
    leaf,
    make_grpo_batch,
    make_head,
    max_err,
    on_device,
)

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.loss_specs import TOKEN_LOSS_TYPES

BACKENDS = ["triton", "chunked"]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def run(fn, hidden, weight, bias, ids, batch, kw, dtype):
    mask, adv, old, ref = batch
    h, w, b = leaf(hidden, dtype), leaf(weight, dtype), leaf(bias, dtype)
    loss, metrics = fn(h, w, ids, adv, mask, old, ref, b, **kw)
    loss.backward()
    return loss.detach(), metrics, [h.grad, w.grad] + ([] if b is None else [b.grad])


def check(backend, dtype, shape, kw, bias, seed=0, **batch_kw):
    B, T, D, V = shape
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=seed, bias=bias,
                                       scale=3.0)
    batch = make_grpo_batch(hidden, weight, b, ids, seed=seed,
                            temperature=kw.get("temperature", 1.0), **batch_kw)
    truth = run(reference.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw,
                torch.float64)
    same = run(reference.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw, dtype)
    with gk.force_backend(backend):
        ours = run(on_device(gk.fused_linear_grpo_loss, backend), hidden, weight, b, ids, batch,
                   kw, dtype)
    tol = TOL[dtype]
    assert ours[0].dtype == torch.float32 and ours[0].dim() == 0
    assert max_err(ours[0], truth[0]) <= 2 * max_err(same[0], truth[0]) + tol * (
        1 + truth[0].abs().item()), "loss"
    assert set(ours[1]) == set(truth[1]), (sorted(ours[1]), sorted(truth[1]))
    for key, value in truth[1].items():
        assert not ours[1][key].requires_grad
        assert max_err(ours[1][key], value) <= 2 * max_err(same[1][key], value) + tol, key
    for name, o, s, t in zip(["d hidden", "d weight", "d bias"], ours[2], same[2], truth[2]):
        assert o.dtype == dtype
        scale = max(t.abs().max().item(), 1e-3)
        assert max_err(o, t) <= 2 * max_err(s, t) + tol * scale, (
            f"{name}: ours {max_err(o, t):.3g} vs torch {max_err(s, t):.3g} (scale {scale:.3g})")


@pytest.mark.parametrize("loss_type,level,beta,temperature,delta,bias", MATRIX)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matrix_fp32(backend, loss_type, level, beta, temperature, delta, bias):
    check(backend, torch.float32, (3, 47, 31, 123),
          hyper(loss_type, level, beta, temperature, delta), bias)


@pytest.mark.parametrize("loss_type,level", TYPE_LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16(backend, loss_type, level):
    check(backend, torch.float16, (3, 47, 31, 123),
          hyper(loss_type, level, 0.04, 0.7, 1.5), bias=True, seed=1)


# bfloat16 (the dtype users train in) on one loss of each kind: clipped, cispo, sapo
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend, loss_type, level):
    check(backend, torch.bfloat16, (3, 47, 31, 123),
          hyper(loss_type, level, 0.04, 0.7, 1.5), bias=True, seed=1)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_head_precision(backend, level):
    """bf16 hidden with a float32 head weight and bias: loss, metrics and gradients near the
    float32 head's (the split dot), each gradient in its input's dtype."""
    B, T, D, V = 3, 47, 31, 123
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=1, bias=True,
                                       scale=3.0)
    hidden = hidden.bfloat16().float()  # the bf16 values, so every path sees the same inputs
    kw = hyper("dapo", level, 0.04, 0.7, 1.5)
    batch = make_grpo_batch(hidden, weight, b, ids, seed=1, temperature=0.7)
    truth = run(reference.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw,
                torch.float64)
    fp32_head = run(reference.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw,
                    torch.float32)
    mask, adv, old, ref = batch
    h, w, bb = leaf(hidden, torch.bfloat16), leaf(weight), leaf(b)
    with gk.force_backend(backend):
        loss, metrics = on_device(gk.fused_linear_grpo_loss, backend)(h, w, ids, adv, mask, old,
                                                                       ref, bb, **kw)
    loss.backward()
    tol = 1e-4
    assert max_err(loss, truth[0]) <= 2 * max_err(fp32_head[0], truth[0]) + tol * (
        1 + truth[0].abs().item()), "loss"
    for key, value in truth[1].items():
        assert max_err(metrics[key], value) <= 2 * max_err(fp32_head[1][key], value) + tol, key
    for name, o, s, t, dtype in zip(["d hidden", "d weight", "d bias"], [h.grad, w.grad, bb.grad],
                                    fp32_head[2], truth[2],
                                    [torch.bfloat16, torch.float32, torch.float32]):
        assert o.dtype == dtype, name
        scale = max(t.abs().max().item(), 1e-3)
        assert max_err(o, t) <= 2 * max_err(s.to(dtype), t) + tol * scale, (
            f"{name}: ours {max_err(o, t):.3g} vs fp32 head {max_err(s, t):.3g}")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "sapo"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_several_vocabulary_tiles(backend, loss_type):
    # V=300 spans 10 tiles of the interpreter's BLOCK_V=32, D=40 spans two D tiles
    check(backend, torch.float32, (2, 19, 40, 300), hyper(loss_type, "token", 0.04, 0.7, None),
          bias=True, seed=2)


EXTRAS = [
    dict(entropy_coef=0.01),
    dict(use_bias_correction_kl=False),  # the default is True, as TRL's
    dict(num_items_in_batch=37),
    dict(entropy_coef=0.02, num_items_in_batch=torch.tensor(50.0)),
    dict(epsilon_low=0.1, epsilon_high=None),
]


@pytest.mark.parametrize("extra", range(len(EXTRAS)))
@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_extras(backend, loss_type, extra):
    kw = hyper(loss_type, "token", 0.04, 0.7, None)
    kw.update(EXTRAS[extra])
    check(backend, torch.float32, (3, 11, 17, 45), kw, bias=False, seed=3 + extra)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_importance_sampling_ratio_and_token_advantages(backend, level):
    B, T, D, V = 3, 11, 17, 45
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=4)
    batch = make_grpo_batch(hidden, weight, b, ids, seed=4, token_adv=True)
    for isr in (torch.rand(B) + 0.5, torch.rand(B, 1) + 0.5, torch.rand(B, T) + 0.5):
        kw = hyper("grpo", level, 0.04, 1.0, None, importance_sampling_ratio=isr)
        truth = run(reference.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw,
                    torch.float64)
        with gk.force_backend(backend):
            ours = run(on_device(gk.fused_linear_grpo_loss, backend), hidden, weight, b, ids,
                       batch, kw, torch.float32)
        assert max_err(ours[0], truth[0]) < 1e-5
        for o, t in zip(ours[2], truth[2]):
            assert max_err(o, t) < 2e-5 * max(1.0, t.abs().max().item())


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_without_old_logps_ratio_is_one(backend, loss_type):
    """old_logps=None means old = logp.detach(): ratio 1, nothing clipped, gradient A·∇logp."""
    B, T, D, V = 2, 7, 9, 33
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=5)
    mask, adv, _, _ = make_grpo_batch(hidden, weight, None, ids, seed=5)
    kw = hyper(loss_type, "token", 0.0, 1.0, None)
    with gk.force_backend(backend):
        loss, metrics = on_device(gk.fused_linear_grpo_loss, backend)(
            leaf(hidden), leaf(weight), ids, adv, mask, **kw)
    truth, _ = reference.fused_linear_grpo_loss(hidden.double(), weight.double(), ids, adv, mask,
                                                **kw)
    assert abs(loss.item() - truth.item()) < 1e-5
    if "clip_ratio/region_mean" in metrics:
        assert metrics["clip_ratio/region_mean"].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_batch_gives_zero_loss_and_gradients(backend):
    B, T, D, V = 2, 5, 8, 21
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=6)
    h, w = leaf(hidden), leaf(weight)
    with gk.force_backend(backend):
        loss, metrics = on_device(gk.fused_linear_grpo_loss, backend)(
            h, w, ids, torch.randn(B), torch.zeros(B, T), loss_type="bnpo")
    loss.backward()
    assert loss.item() == 0.0 and metrics["entropy"].item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0



@pytest.mark.parametrize("delta", [None, 1.5])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo", "dppo"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_ratio_gives_a_nan_loss(backend, loss_type, delta):
    """A NaN old log-prob (or hidden state) at a real token makes the ratio NaN, and the loss
    NaN, as the reference's torch.minimum / torch.clamp give it: Triton's min / max drop a NaN
    operand by default, and the epilogue once returned a finite loss here."""
    B, T, D, V = 2, 3, 8, 11
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=11)
    adv, old = torch.tensor([1.0, -1.0]), torch.full((B, T), -2.4)
    nan_old, nan_hidden = old.clone(), hidden.clone()
    nan_old[0, 1] = nan_old[1, 2] = float("nan")
    nan_hidden[1, 0, 0] = float("nan")
    kw = hyper(loss_type, "token", 0.0, 1.0, delta)
    for h, o in ((hidden, nan_old), (nan_hidden, old)):
        truth, _ = reference.fused_linear_grpo_loss(h, weight, ids, adv, None, o, **kw)
        assert truth.isnan()
        with gk.force_backend(backend):
            loss, _ = on_device(gk.fused_linear_grpo_loss, backend)(leaf(h), weight, ids, adv,
                                                                   None, o, **kw)
            from_logits, _ = on_device(gk.grpo_loss, backend)(h @ weight.T, ids, adv, None, o,
                                                              **kw)
        assert loss.isnan() and from_logits.isnan(), (loss, from_logits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_rollout_ratio_gives_nan_gradients(backend):
    """A NaN rollout importance-sampling ratio at one token: the loss is NaN and so is the
    d hidden of that token's row, as in the reference. The row kernels skip a block whose
    rows have no gradient; a reduction's max drops a NaN beside zeros, which once skipped the
    broken row's block and gave it zeros."""
    B, T, D, V = 2, 3, 8, 11
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=12)
    # advantage 0 for the second sequence: in the row blocks of its tokens, the broken token's
    # row is the only one whose gradient is not 0
    adv, old = torch.tensor([1.0, 0.0]), torch.full((B, T), -2.4)
    isr = torch.ones(B, T)
    isr[1, 1] = float("nan")
    kw = dict(loss_type="dapo", beta=0.0, importance_sampling_ratio=isr)
    h, x = leaf(hidden), leaf(hidden)
    truth, _ = reference.fused_linear_grpo_loss(h, weight, ids, adv, None, old, **kw)
    truth.backward()
    with gk.force_backend(backend):
        loss, _ = on_device(gk.fused_linear_grpo_loss, backend)(x, weight, ids, adv, None, old,
                                                                **kw)
        loss.backward()
    assert truth.isnan() and loss.isnan()
    want, got = h.grad.isnan().any(-1), x.grad.isnan().any(-1)
    assert want[1, 1] and torch.equal(got, want), (got, want)


def test_module_matches_function():
    B, T, D, V = 2, 6, 8, 30
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=8)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, None, ids, seed=8)
    module = gk.FusedLinearGRPOLoss(beta=0.04, loss_type="grpo", temperature=0.9)
    a, ma = module(hidden, weight, ids, adv, mask, old, ref)
    b, mb = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old, ref, beta=0.04,
                                      loss_type="grpo", temperature=0.9)
    assert torch.equal(a, b) and ma.keys() == mb.keys()
    assert "loss_type='grpo'" in repr(module)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "sapo", "luspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bf16_real_head_on_gpu(loss_type, level):
    B, T, D, V = 4, 300, 896, 151936
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cuda", seed=9, scale=4.0)
    batch = make_grpo_batch(hidden, weight, b, ids, seed=9)
    kw = hyper(loss_type, level, 0.04, 0.7, None)
    truth = run(reference.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw,
                torch.float64)
    same = run(reference.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw,
               torch.bfloat16)
    ours = run(gk.fused_linear_grpo_loss, hidden, weight, b, ids, batch, kw, torch.bfloat16)
    assert max_err(ours[0], truth[0]) <= 2 * max_err(same[0], truth[0]) + 1e-3
    for o, s, t in zip(ours[2], same[2], truth[2]):
        assert o.dtype == torch.bfloat16
        assert max_err(o, t) <= 2 * max_err(s, t) + 1e-2 * t.abs().max().item()
