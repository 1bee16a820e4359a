"""Logits-input path: logprobs_from_logits and grpo_loss on the Triton kernels (interpreter on
CPU) and the chunked PyTorch path, against the float64 reference, over the same matrix as the
fused linear loss; sliced views read in place; the in-place gradient option."""

import pytest
import torch
from helpers import KERNEL_DEVICE, MATRIX, TYPE_LEVELS, hyper, max_err, on_device

import grpo_kernels as gk
from grpo_kernels import reference

BACKENDS = ["triton", "chunked"]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def make_logits(B, T, V, seed=0, scale=3.0, pad=3):
    """A [B, T, V] view sliced out of a [B, T+pad, V] buffer (as a model's logits[:, -T-1:-1])."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(B, T + pad, V, generator=g) * scale
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    if B > 1:
        mask[1] = 0.0
    adv = torch.randn(B, generator=g)
    return full, ids, mask, adv


def run_loss(fn, full, T, dtype, ids, batch, kw, device=None):
    """Loss, metrics and d buffer of fn on the view buf[:, 1:1+T], computed on `device` (default:
    the buffer's; the buffer moves there whole, so the kernel still reads a sliced view);
    loss and metrics on the CPU."""
    buf = full.detach().to(dtype).clone().requires_grad_(True)
    device = device or buf.device
    logits = buf.to(device)[:, 1:1 + T]  # a non-contiguous view
    moved = [x if x is None else x.to(device) for x in batch]
    loss, metrics = fn(logits, ids.to(device), *moved, **kw)
    loss.backward()
    return loss.detach().cpu(), {k: v.cpu() for k, v in metrics.items()}, buf.grad


def check(backend, dtype, B, T, V, kw, seed=0):
    full, ids, mask, adv = make_logits(B, T, V, seed)
    with torch.no_grad():
        lp = reference.logprobs_from_logits(full[:, 1:1 + T].double(), ids,
                                            temperature=kw["temperature"]).float()
    g = torch.Generator().manual_seed(seed + 1)
    args = (adv, mask, lp + 0.25 * torch.randn(B, T, generator=g),
            lp + 0.25 * torch.randn(B, T, generator=g))
    truth = run_loss(reference.grpo_loss, full, T, torch.float64, ids, args, kw)
    same = run_loss(reference.grpo_loss, full, T, dtype, ids, args, kw)
    with gk.force_backend(backend):
        ours = run_loss(gk.grpo_loss, full, T, dtype, ids, args, kw,
                        KERNEL_DEVICE if backend == "triton" else "cpu")
    tol = TOL[dtype]
    assert max_err(ours[0], truth[0]) <= 2 * max_err(same[0], truth[0]) + tol * (
        1 + truth[0].abs().item())
    assert ours[1].keys() == truth[1].keys()
    for key in truth[1]:
        assert max_err(ours[1][key], truth[1][key]) <= 2 * max_err(same[1][key], truth[1][key]) \
            + tol, key
    assert ours[2].dtype == dtype
    scale = max(truth[2].abs().max().item(), 1e-3)
    assert max_err(ours[2], truth[2]) <= 2 * max_err(same[2], truth[2]) + tol * scale
    # positions outside the view get no gradient
    assert torch.count_nonzero(ours[2][:, 0]) == 0 and torch.count_nonzero(ours[2][:, 1 + T:]) == 0


@pytest.mark.parametrize("loss_type,level,beta,temperature,delta",
                         sorted({cell[:5] for cell in MATRIX}, key=str))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matrix_fp32(backend, loss_type, level, beta, temperature, delta):
    check(backend, torch.float32, 3, 23, 123, hyper(loss_type, level, beta, temperature, delta))


@pytest.mark.parametrize("loss_type,level", TYPE_LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16(backend, loss_type, level):
    check(backend, torch.float16, 3, 23, 123, hyper(loss_type, level, 0.04, 0.7, 1.5), seed=1)


# bfloat16 (the dtype users train in) on one loss of each kind: clipped, cispo, sapo
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend, loss_type, level):
    check(backend, torch.bfloat16, 3, 23, 123, hyper(loss_type, level, 0.04, 0.7, 1.5), seed=1)


@pytest.mark.parametrize("extra", [dict(entropy_coef=0.01), dict(num_items_in_batch=29),
                                   dict(use_bias_correction_kl=False)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_extras_and_several_tiles(backend, extra):
    # V=300: five tiles of the interpreter's BLOCK_V=64
    check(backend, torch.float32, 2, 9, 300, hyper("dapo", "token", 0.04, 0.7, None, **extra))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_from_logits(backend, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 77, generator=g) * 4
    ids = torch.randint(0, 77, (2, 3, 5), generator=g)
    coef = torch.randn(2, 2, 3, 5, generator=g)

    def grads(fn, x):
        x = x.detach().clone().requires_grad_(True)
        logp, ent = fn(x, ids, temperature=0.8, return_entropy=True)
        ((coef[0] * logp).sum() + (coef[1] * ent).sum()).backward()
        return logp.detach(), ent.detach(), x.grad

    truth = grads(reference.logprobs_from_logits, x.double())
    same = grads(reference.logprobs_from_logits, x.to(dtype))
    with gk.force_backend(backend):
        ours = grads(on_device(gk.logprobs_from_logits, backend), x.to(dtype))
    assert ours[0].shape == (2, 3, 5) and ours[0].dtype == torch.float32
    for o, s, t in zip(ours, same, truth):
        assert max_err(o, t) <= 2 * max_err(s, t) + TOL[dtype] * max(1.0, t.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_writes_the_gradient_over_the_logits(backend):
    full, ids, mask, adv = make_logits(2, 7, 50, seed=4)
    expected = run_loss(reference.grpo_loss, full, 7, torch.float64, ids, (adv, mask, None, None),
                        dict(loss_type="grpo"))[2][:, 1:8]
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    buf = full.to(device).requires_grad_(True)
    logits = buf * 1.0  # non-leaf buffer whose storage the gradient may reuse
    view = logits[:, 1:8]
    with gk.force_backend(backend):
        loss, _ = gk.grpo_loss(view, ids.to(device), adv.to(device), mask.to(device),
                               loss_type="grpo", inplace=True)
    loss.backward()
    assert max_err(buf.grad[:, 1:8].cpu(), expected) < 1e-5
    assert max_err(view.detach().cpu(), expected) < 1e-5, "the view now holds its own gradient"


def test_module_and_errors():
    full, ids, mask, adv = make_logits(2, 5, 20)
    module = gk.GRPOLoss(loss_type="bnpo", beta=0.0)
    a, _ = module(full[:, :5], ids, adv, mask)
    b, _ = gk.grpo_loss(full[:, :5], ids, adv, mask, loss_type="bnpo")
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="logits must have 3 dimensions"):
        gk.grpo_loss(full[0], ids, adv)
    with pytest.raises(TypeError, match="logits must be a floating-point"):
        gk.grpo_loss(full.long()[:, :5], ids, adv)
    with pytest.raises(ValueError, match=r"outside \[0, 20\) \(vocabulary size = logits"):
        gk.grpo_loss(full[:, :5], ids + 20, adv)
    with pytest.raises(ValueError, match="targets must have shape"):
        gk.logprobs_from_logits(full, ids)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sliced_view_is_saved_not_copied(backend, level):
    """logits[:, :-1] of a [B, T + 1, V] output: the only [B, T, V]-sized tensor autograd saves
    is the view itself (its storage), nothing of it in float32 or copied."""
    full, ids, mask, adv = make_logits(2, 5, 40, pad=1)
    buf = full.to(KERNEL_DEVICE, torch.bfloat16).requires_grad_(True)
    view = buf[:, :-1]
    saved = []
    with gk.force_backend(backend), torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t):
        loss, _ = gk.grpo_loss(view, ids.to(KERNEL_DEVICE), adv.to(KERNEL_DEVICE),
                               mask.to(KERNEL_DEVICE), importance_sampling_level=level)
    big = [t for t in saved if t.numel() >= view.numel()]
    assert big and all(t.dtype == torch.bfloat16 and t.data_ptr() == view.data_ptr()
                       and t.stride() == view.stride() for t in big), [
        (t.dtype, tuple(t.shape), t.stride()) for t in big]
    loss.backward()
    assert buf.grad[:, -1].abs().sum() == 0 and buf.grad[:, :-1].abs().sum() > 0


@pytest.mark.parametrize("fn", [gk.grpo_loss, reference.grpo_loss], ids=["ours", "reference"])
def test_unshifted_and_unpacked_logits_are_named(fn):
    """A model's whole [B, T + 1, V] output, or packed [N, V] logits without cu_seqlens: the
    error names logits and says what to pass, not only completion_ids' shape."""
    full, ids, mask, adv = make_logits(2, 5, 20, pad=1)  # full: [2, 6, 20]
    with pytest.raises(ValueError, match=r"logits has 6 positions for completion_ids' 5: .*"
                                         r"pass logits\[:, :-1\]"):
        fn(full, ids, adv, mask)
    fn(full[:, :-1], ids, adv, mask)  # the view is accepted
    with pytest.raises(ValueError, match=r"\[N, V\] need cu_seqlens"):
        fn(full[:, :-1].reshape(-1, 20), ids.reshape(-1), adv)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "sapo"])
def test_bf16_vocab_scale_on_gpu(loss_type):
    B, T, V = 4, 512, 151936
    full = torch.randn(B, T + 1, V, device="cuda") * 3
    ids = torch.randint(0, V, (B, T), device="cuda")
    mask = (torch.rand(B, T, device="cuda") > 0.2).float()
    adv = torch.randn(B, device="cuda")
    args = (adv, mask, None, None)
    kw = hyper(loss_type, "token", 0.0, 0.7, None)
    truth = run_loss(reference.grpo_loss, full.cpu(), T, torch.float64, ids.cpu(),
                     tuple(a if a is None else a.cpu() for a in args), kw)
    same = run_loss(reference.grpo_loss, full, T, torch.bfloat16, ids, args, kw)
    ours = run_loss(gk.grpo_loss, full, T, torch.bfloat16, ids, args, kw)
    assert max_err(ours[0].cpu(), truth[0]) <= 2 * max_err(same[0].cpu(), truth[0]) + 1e-3
    assert max_err(ours[2].cpu(), truth[2]) <= 2 * max_err(same[2].cpu(), truth[2]) + 1e-4
