"""The row kernels at rows that one token other than the target dominates (z/τ = 40, the target
and the rest at 40 - margin - |noise|): that token's d logits is -g·p with p ≈ 1, no
cancellation, but p read through the float32 lse, e^(z - lse), carries the lse's rounding at its
magnitude (about 2e-6 at 40). Read against the row forward's m and log s, p = e^((z - m) - log s)
as the forward formed it: the backward given the forward's `split_out` (the three-pass route's
two kernels) and the fused kernel, which keeps them in registers. d logits against a float64
truth of the same coefficients stay within twice PyTorch's float32 error (softmax in float32)
plus one float32 ulp of the largest coefficient."""

import pytest
import torch
from helpers import KERNEL_DEVICE

from grpo_kernels.kernels import logits_logprobs as rows_kernels
from grpo_kernels.kernels import logits_loss_grad as fused_kernel
from grpo_kernels.kernels.epilogue import epilogue_args
from grpo_kernels.params import GRPOParams

pytestmark = pytest.mark.usefixtures("one_thread")
N, V = 12, 64


def dominated_rows(temperature):
    """logits [N, 1, V] float32 (raw: z = logits / τ), targets [N]: column (target + 1) % V at
    z = 40 dominates each row, the target at 40 - margin, the others lower."""
    g = torch.Generator().manual_seed(11)
    margin = torch.linspace(12.0, 30.0, N)[:, None]
    z = 40.0 - margin - torch.rand(N, V, generator=g) * 8.0
    ids = torch.randint(0, V, (N,), generator=g)
    z.scatter_(1, ids[:, None], 40.0 - margin)
    z.scatter_(1, ((ids + 1) % V)[:, None], 40.0)
    return (z * temperature).view(N, 1, V).to(KERNEL_DEVICE), ids.to(KERNEL_DEVICE)


def check(d_logits, logits, ids, coef, temperature):
    """d logits = coef·(onehot - p) / τ against float64, within twice float32 softmax's error."""
    def grad(x):
        p = torch.softmax(x.view(N, V) / temperature, dim=-1)
        onehot = torch.nn.functional.one_hot(ids, V).to(x.dtype)
        return coef.to(x.dtype)[:, None] * (onehot - p) / temperature

    x = logits.cpu()
    coef, ids = coef.cpu(), ids.cpu()
    truth = grad(x.double())
    torch32 = (grad(x).double() - truth).abs().max().item()
    ours = (d_logits.cpu().view(N, V).double() - truth).abs().max().item()
    floor = torch.finfo(torch.float32).eps * coef.abs().max().item() / temperature
    assert ours <= 2.0 * torch32 + floor, (ours, torch32, floor)


@pytest.mark.parametrize("temperature", [1.0, 0.01])
def test_backward_with_the_forwards_split(temperature):
    """`logits_logprob_forward(split_out=...)`, then `logits_logprob_backward(split=...)`."""
    x, ids = dominated_rows(temperature)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    split = tuple(torch.empty(N, device=KERNEL_DEVICE) for _ in range(2))
    logp, ent, lse = rows_kernels.logits_logprob_forward(x, ids, temperature, split_out=split)
    torch.testing.assert_close(split[0] + split[1], lse, rtol=0, atol=0)  # lse = m + log s
    dx = rows_kernels.logits_logprob_backward(x, ids, lse, ent, coef, None, temperature,
                                              logp=logp, split=split)
    check(dx, x, ids, coef, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.01])
def test_fused_kernel(temperature):
    """`logits_loss_grad.logits_loss_grad` (dapo, beta = 0.04): the coefficients from its own
    epilogue, p from its first sweep's m and log s."""
    x, ids = dominated_rows(temperature)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(3))
    logp = torch.log_softmax(x.cpu().view(N, V).double() / temperature, -1)[
        torch.arange(N), ids.cpu()].float()
    weights = torch.full((N,), 1.0 / N)
    rule = GRPOParams(beta=0.04, loss_type="dapo").token_loss_args
    # on-policy (the ratio 1, nothing clipped), the reference log-probs 0.1 above
    ep = epilogue_args(rule, *(t.to(KERNEL_DEVICE) for t in (weights, adv)), None,
                       (logp + 0.1).to(KERNEL_DEVICE), None)
    stats = tuple(torch.empty(N, device=KERNEL_DEVICE) for _ in range(3))
    dx = torch.empty_like(x)
    fused_kernel.logits_loss_grad(x, ids, temperature, ep, None, stats, dx)
    check(dx, x, ids, ep.outputs[1], temperature)


@pytest.mark.parametrize("entropy", [False, True])
def test_split_beside_skipped_rows(entropy):
    """The forward with the epilogue skipping padding (`skip_zero_weight`) and writing m, log s
    (`split_out`), as the logits-input GRPO operator runs it: a skipped row's m is NaN, its
    mark; the backward given `split` and `skipped_rows` recomputes such a row where it has a
    gradient (its lse for m, 0 for log s) and reads the others against the forward's m and
    log s. d logits as a forward that skips nothing, at every row."""
    x, ids = dominated_rows(1.0)
    gen = torch.Generator().manual_seed(4)
    weights = torch.full((N,), 1.0 / N)
    weights[:4] = 0.0  # the first row block (4 rows at V = 64) is skipped, padding
    adv = torch.randn(N, generator=gen)
    rule = GRPOParams(loss_type="dapo").token_loss_args
    ep = epilogue_args(rule, weights.to(KERNEL_DEVICE), adv.to(KERNEL_DEVICE), None, None, None)
    split = tuple(torch.empty(N, device=KERNEL_DEVICE) for _ in range(2))
    logp, ent, lse = rows_kernels.logits_logprob_forward(x, ids, 1.0, ep, split_out=split,
                                                         skip_zero_weight=True)
    skipped = torch.isnan(lse).cpu()
    assert skipped.any() and not skipped.all()
    assert torch.equal(torch.isnan(split[0]).cpu(), skipped)
    full = rows_kernels.logits_logprob_forward(x, ids, 1.0)
    g = torch.randn(N, generator=gen).to(KERNEL_DEVICE)  # padding too gets a gradient here
    gh = 0.3 * g.flip(0) if entropy else None
    got = rows_kernels.logits_logprob_backward(x, ids, lse, ent, g, gh, 1.0, logp=logp,
                                               skipped_rows=True, split=split)
    want = rows_kernels.logits_logprob_backward(x, ids, full[2], full[1], g, gh, 1.0,
                                                logp=full[0])
    assert torch.isnan(split[0][skipped.to(KERNEL_DEVICE)]).all()  # saved marks kept
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
