"""The row kernels' d logits written over the logits they read (kernels/logits_logprobs.py,
`shared_rows`; the three-pass route's one chunk buffer, `linear_loss_grad.dlogits_over`): a
16-bit d logits row in the first half of its float32 logits row's bytes, and a float32 one in
place. The results must be bit-identical to those written into a buffer of their own, from the
backward kernel and from the fused kernel, with several row blocks and column blocks. On a GPU
the vocabulary is a real one (V = 151,936: 38 column blocks, so a store that overtook another
thread's read would show); in Triton's interpreter a small one. Any other overlap of d logits
and logits is refused with an error that names both."""

import pytest
import torch
from helpers import KERNEL_DEVICE

from grpo_kernels.kernels import linear_loss_grad as llg
from grpo_kernels.kernels import logits_logprobs as rows_kernels
from grpo_kernels.kernels import logits_loss_grad as fused_kernel
from grpo_kernels.kernels.epilogue import epilogue_args
from grpo_kernels.params import GRPOParams

pytestmark = pytest.mark.usefixtures("one_thread")
ON_GPU = KERNEL_DEVICE.type == "cuda"
C, V = (96, 151936) if ON_GPU else (6, 300)  # 300: several 64-wide column blocks on the CPU


def chunk(seed=0):
    """A float32 logits chunk [C, V] as the three-pass route holds it, its targets, and the
    row statistics and coefficients of a loss over it (every row with a gradient but two)."""
    g = torch.Generator().manual_seed(seed)
    y = (3.0 * torch.randn(C, V, generator=g)).to(KERNEL_DEVICE)
    ids = torch.randint(0, V, (C,), generator=g).to(KERNEL_DEVICE)
    coef = torch.randn(C, generator=g).to(KERNEL_DEVICE)
    coef[1] = coef[-1] = 0.0  # rows without a gradient: written as zeros
    g_ent = (0.1 * torch.rand(C, generator=g)).to(KERNEL_DEVICE)
    g_ent[1] = g_ent[-1] = 0.0
    return y, ids, coef, g_ent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("entropy", [False, True], ids=["", "g_entropy"])
def test_backward_over_its_logits(dtype, entropy):
    y, ids, coef, g_ent = chunk(1)
    g_ent = g_ent if entropy else None
    logp, ent, lse = rows_kernels.logits_logprob_forward(y.view(C, 1, V), ids, 0.7)
    own = torch.empty(C, 1, V, device=y.device, dtype=dtype)
    rows_kernels.logits_logprob_backward(y.view(C, 1, V), ids, lse, ent, coef, g_ent, 0.7,
                                         out=own)
    over = llg.dlogits_over(y, dtype)
    assert over.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert over.stride() == (V * 4 // dtype.itemsize, 1)
    rows_kernels.logits_logprob_backward(y.view(C, 1, V), ids, lse, ent, coef, g_ent, 0.7,
                                         out=over.view(C, 1, V))
    assert torch.equal(over, own.view(C, V))
    assert not over[1].any() and not over[-1].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_over_its_logits(dtype):
    y, ids, _, g_ent = chunk(2)
    N = C
    g = torch.Generator().manual_seed(3)
    mk = lambda: torch.randn(N, generator=g).to(KERNEL_DEVICE)  # noqa: E731
    weights = torch.full((N,), 1.0 / N, device=KERNEL_DEVICE)
    rule = GRPOParams(beta=0.04, loss_type="dapo").token_loss_args

    def run(dx):
        ep = epilogue_args(rule, weights, adv, old, ref, None)
        stats = tuple(torch.empty(N, device=KERNEL_DEVICE) for _ in range(3))
        fused_kernel.logits_loss_grad(y.view(N, 1, V), ids, 0.9, ep, g_ent, stats,
                                      dx.view(N, 1, V))
        return torch.stack([*stats, *ep.outputs])

    adv, old, ref = mk(), -5.0 + 0.1 * mk(), -5.0 + 0.1 * mk()
    own = torch.empty(N, V, device=y.device, dtype=dtype)
    expect = run(own)
    over = llg.dlogits_over(y, dtype)
    got = run(over)  # reads y, then writes over it
    assert torch.equal(got, expect)
    assert torch.equal(over, own)


BAD_LAYOUTS = ("the second half of each row", "rows packed closer than the logits'",
               "each row one row on", "wider than the logits")


@pytest.mark.parametrize("what", BAD_LAYOUTS)
def test_other_overlaps_are_refused(what):
    _, ids, coef, _ = chunk(4)
    big = (3.0 * torch.randn(C + 1, 2 * V)).to(KERNEL_DEVICE)  # room for every bad layout
    x = big[:C, :V].reshape(C, 1, V)  # the logits: rows of V float32 at a row stride of 2V
    logp, ent, lse = rows_kernels.logits_logprob_forward(x, ids, 1.0)
    halves = big.view(torch.bfloat16)  # [C + 1, 4V]
    dx = dict(zip(BAD_LAYOUTS, (
        halves[:C, 2 * V:3 * V], halves.view(-1)[:C * V].view(C, V), halves[1:, :V],
        big.view(torch.float64)[:C, :V])))[what]
    with pytest.raises(ValueError, match="share the logits' memory but not their rows"):
        rows_kernels.logits_logprob_backward(x, ids, lse, ent, coef, None, 1.0,
                                             out=dx.view(C, 1, V))


def test_supported_overlaps():
    x = torch.randn(C, 2 * V, device=KERNEL_DEVICE)[:, :V].reshape(C, 1, V)
    assert rows_kernels.shared_rows(x, x)
    assert rows_kernels.shared_rows(x, x.view(torch.bfloat16)[..., :V])  # row n at row n's bytes
    assert not rows_kernels.shared_rows(x, torch.empty_like(x))
