"""Value checks without a host read (grpo_kernels/value_checks.py): a device check's error comes
at the next check or backward, the call that found it has a NaN loss, and on a GPU the
three-pass route reads nothing back to the host for a packed batch. The queue's logic runs
here with CPU flags (ready at once); the CUDA tests run where a GPU is."""

import pytest
import torch
from helpers import leaf, make_head

import grpo_kernels as gk
from grpo_kernels import value_checks

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def empty_queue():
    value_checks._PENDING.clear()
    yield
    value_checks._PENDING.clear()


def test_a_failed_check_raises_at_the_next_one_and_a_passed_one_never():
    value_checks.defer(torch.tensor(False), "not raised")
    value_checks.raise_ready()
    assert not value_checks._PENDING
    value_checks.defer(torch.tensor(True), "completion_ids has a token id outside [0, 5)")
    with pytest.raises(ValueError, match=r"outside \[0, 5\) \(found by a device check of an "
                                         r"earlier call; that call's loss was NaN\)"):
        value_checks.defer(torch.tensor(False), "the next call's check")
    value_checks.raise_ready()  # the failure was raised once; the next check is queued


def test_poison_makes_the_loss_nan_only_where_a_check_failed():
    x = torch.tensor(1.5)
    assert value_checks.poison(x, None) is x
    assert value_checks.poison(x, torch.tensor(False)).item() == 1.5
    assert value_checks.poison(x, torch.tensor(True)).isnan()


@gpu
def test_a_non_finite_cuda_mask_is_a_device_check():
    """A NaN in a CUDA completion_mask: that call's loss is NaN (or the call raises, where its
    own device check finds the flag already landed), and the error names the mask."""
    hidden, weight, _, ids = make_head(2, 8, 16, 64, torch.float32, "cuda", seed=1)
    mask = torch.ones(2, 8, device="cuda")
    mask[1, 3] = float("nan")
    with pytest.raises(ValueError, match="completion_mask contains NaN or inf"):
        loss, _ = gk.fused_linear_grpo_loss(leaf(hidden), weight, ids,
                                            torch.randn(2, device="cuda"), mask)
        assert loss.isnan()
        value_checks.raise_ready(wait=True)


def _packed_call(device, ids_offset=0):
    hidden, weight, _, ids = make_head(1, 48, 16, 257, torch.bfloat16, device, seed=3)
    h, w = leaf(hidden.reshape(48, 16)), torch.nn.Parameter(weight)
    cu = torch.tensor([0, 20, 20, 48], device=device)
    adv = torch.randn(3, device=device)
    loss, metrics = gk.fused_linear_grpo_loss(h, w, ids.reshape(-1) + ids_offset, adv,
                                              cu_seqlens=cu, beta=0.0, entropy_coef=0.01)
    return loss, metrics, (h, w)


@gpu
def test_the_cuda_three_pass_route_reads_nothing_back_for_a_packed_batch():
    _packed_call("cuda")  # warm-up: Triton compiles, the allocator grows
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _, (h, w) = _packed_call("cuda")
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item() and h.grad is not None and w.grad is not None


@gpu
def test_a_bad_id_on_cuda_gives_a_nan_loss_then_its_error():
    loss, _, _ = _packed_call("cuda", ids_offset=300)  # ids beyond V = 257
    assert loss.isnan().item()
    with pytest.raises(ValueError, match=r"completion_ids has a token id outside \[0, 257\)"):
        value_checks.raise_ready(wait=True)
