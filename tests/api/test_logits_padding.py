"""Padding on the logits-input loss (`grpo_loss`, Triton): a row block whose tokens all have
weight 0 is not read (`logits_logprob_forward(skip_zero_weight=True)`). Shown by NaN logits
there, which change nothing; its per-token values are the documented fills (log-prob and
entropy 0, ratio 1); and a gradient that does reach such a row (through the differentiable
per-token terms of `return_terms=True`) is exact, its statistics recomputed in the backward, on
the Triton backend and on the chunked launcher that replaces a Triton backward that failed to
build. The rows of batch item 1 are all padding: whole row blocks at any block size."""

import pytest
import torch
from helpers import KERNEL_DEVICE, max_err

import grpo_kernels as gk
from grpo_kernels import chunked

B, T, V = 3, 8, 300  # V = 300: several column blocks in the interpreter (BLOCK_V = 64)


def batch(seed=0, old_at_padding=-120.0):
    """Logits [B, T, V] and the GRPO inputs; old log-probs at padding are `old_at_padding`:
    anything goes there on the skipping route (-120 would overflow a ratio e^(logp - old))."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[1] = 0.0  # a whole sequence of padding
    adv = torch.randn(B, generator=g)
    old = -6.0 + torch.randn(B, T, generator=g)
    old[1] = old_at_padding
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    return logits, ids, mask, adv, old, ref


def loss_and_grad(logits, backend="triton", old_at_padding=-120.0, **kw):
    _, ids, mask, adv, old, ref = batch(old_at_padding=old_at_padding)
    x = logits.detach().to(KERNEL_DEVICE if backend == "triton" else "cpu").clone()
    x.requires_grad_(True)
    move = lambda t: t.to(x.device)  # noqa: E731
    with gk.force_backend(backend):
        out = gk.grpo_loss(x, move(ids), move(adv), move(mask), move(old), move(ref),
                           loss_type="dapo", beta=0.04, entropy_coef=0.01, **kw)
    return out, x


def test_padding_is_not_read():
    logits = batch()[0]
    (loss, metrics), x = loss_and_grad(logits)
    loss.backward()
    poisoned = logits.clone()
    poisoned[1] = float("nan")
    (loss_p, metrics_p), x_p = loss_and_grad(poisoned)
    loss_p.backward()
    assert torch.isfinite(loss_p) and torch.equal(loss_p, loss)
    for k in metrics:
        assert torch.equal(metrics_p[k], metrics[k]), k
    assert torch.equal(x_p.grad, x.grad)
    assert not x.grad[1].any()


def test_fills_at_padding():
    (_, _, terms), _ = loss_and_grad(batch()[0], return_token_values=True)
    assert not terms.logp[1].any() and not terms.entropy[1].any()
    assert torch.equal(terms.ratio[1], torch.ones_like(terms.ratio[1]))
    assert not terms.kl[1].any()
    assert torch.isfinite(terms.ratio).all() and torch.isfinite(terms.kl).all()
    # and the rows with weight are the chunked backend's
    (_, _, full), _ = loss_and_grad(batch()[0], "chunked", -20.0, return_token_values=True)
    keep = batch()[2].bool()
    assert max_err(terms.logp[keep.to(terms.logp.device)].cpu(), full.logp[keep]) < 1e-5


@pytest.mark.parametrize("through", ["logp", "entropy"])
def test_gradient_reaching_padding_is_exact(through):
    """Σ c·logp (or Σ c·H) over every token, padding included, beside the loss: the backward
    recomputes the skipped rows' statistics, so d logits there are the chunked backend's (which
    computes every row, padding included: its old log-probs there must keep e^(logp - old)
    finite, as in TRL, where 0·inf would be NaN)."""
    c = torch.linspace(-1.0, 1.0, B * T).view(B, T)
    grads = []
    for backend in ("triton", "chunked"):
        terms, x = loss_and_grad(batch()[0], backend, -20.0, return_terms=True)
        extra = getattr(terms, through) * c.to(x.device)
        (terms.policy_loss + extra.sum()).backward()
        grads.append(x.grad.cpu())
    assert grads[0][1].abs().max() > 0.01  # padding has a gradient here
    assert max_err(grads[0], grads[1]) < 1e-5


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_backward_recomputes_marked_rows(with_entropy):
    """The chunked launcher, as it replaces a Triton backward that failed to build: rows whose
    lse is NaN (skipped by the Triton forward) are recomputed before the gradient."""
    logits, ids, *_ = batch(1)
    x, ids = logits.view(B * T, 1, V), ids.view(-1)
    logp, ent, lse = chunked.logits_logprob_forward(x, ids, 0.9)
    g = torch.randn(B * T, generator=torch.Generator().manual_seed(2))
    gh = 0.3 * g.flip(0) if with_entropy else None
    expect = chunked.logits_logprob_backward(x, ids, lse, ent, g, gh, 0.9)
    marked_lse, marked_ent = lse.clone(), ent.clone()
    marked_lse[T:2 * T], marked_ent[T:2 * T] = float("nan"), 0.0
    got = chunked.logits_logprob_backward(x, ids, marked_lse, marked_ent, g, gh, 0.9,
                                          skipped_rows=True)
    assert torch.isnan(marked_lse[T:2 * T]).all()  # the saved statistics stay as they were
    assert max_err(got, expect) < 1e-6


@pytest.mark.parametrize("where", ["g_logp", "g_ent"])
def test_a_nan_gradient_beside_zero_rows_is_not_skipped(where):
    """A block whose rows have no gradient is skipped (zeros, no read); a NaN gradient (a
    broken token) beside zeros in one block must still give that row NaN d logits, as torch
    does, not zeros: the skip test counts NaN as a gradient."""
    from grpo_kernels.kernels.logits_logprobs import logits_logprob_backward

    logits, ids, *_ = batch()
    x = logits.reshape(1, B * T, V)[:, :8].to(KERNEL_DEVICE)  # 8 rows: one block or two
    lse = x[0].float().logsumexp(-1)
    ent = torch.zeros(8, device=x.device)
    g = torch.zeros(8, device=x.device)
    g_nan = g.clone()
    g_nan[0] = float("nan")
    g_logp, g_ent = (g_nan, None) if where == "g_logp" else (g, g_nan)
    d = logits_logprob_backward(x, ids.reshape(-1)[:8].to(x.device), lse, ent, g_logp, g_ent,
                                1.0)[0]
    assert d[0].isnan().all(), d[0]
    assert (d[1:] == 0).all()  # the rows without a gradient: zeros
