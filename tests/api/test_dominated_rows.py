"""Rows where one token takes almost all the probability, at large |z/τ| (target logit z/τ = 40,
at τ = 1 and at τ = 0.01 with moderate raw logits), on the chunked backend: the gradients of
hidden and weight against a float64 truth stay within twice PyTorch's own float32 error (plus a
tiny floor), on the three-pass route and on the four-pass route (GRPO_KERNELS_THREE_PASS=0,
whose eager backward starts from the forward's kept logits tile: N·V within
`chunked.blocks.KEEP_ELEMENTS`), for the GRPO loss and for selective log-probs with and without
an entropy term.

Such a row's d logits of the dominant token is g·(1 - p), a cancellation: p must come out of the
backward as the forward's statistics define it (2^(z - m) / s), not through the lse in nats,
whose float32 rounding at |lse| ≈ 40 (2e-6) would show as an error of that size in 1 - p.
"""

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import reference

pytestmark = pytest.mark.usefixtures("one_thread")
MARGINS = [40.0, 30.0, 25.0, 20.0, 15.0, 12.0]  # target logit minus a rival's (z/τ), per token


def dominated_head(V, temperature, D=16, B=2, T=6):
    """hidden [B, T, D] (orthogonal rows, |h| = 4), weight [V, D], ids [B, T]: each token's
    target logit z/τ is 40, one rival's 40 - margin (1 - p from e^-40 to about e^-12), the
    others small."""
    N = B * T
    g = torch.Generator().manual_seed(V)
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    h = q[:N] * 4.0
    perm = torch.randperm(V, generator=g)
    ids, rivals = perm[:N], perm[N:2 * N]
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * (0.3 * temperature)
    w[ids] = h / 16.0 * (40.0 * temperature)  # h_n · w[target_n] = 40·τ
    margin = torch.tensor(MARGINS * B, dtype=torch.float64)
    w[rivals] = h / 16.0 * ((40.0 - margin) * temperature)[:, None]
    return h.float().view(B, T, D), w.float(), ids.view(B, T)


def grads(fn, hidden, weight):
    h, w = (x.detach().clone().requires_grad_(True) for x in (hidden, weight))
    fn(h, w).backward()
    return h.grad, w.grad


def errors(ours_fn, ref_fn, hidden, weight):
    """[(ours' error, PyTorch float32's error)] of d hidden and d weight, max abs against the
    float64 reference on the same values."""
    truth = grads(ref_fn, hidden.double(), weight.double())
    torch32 = grads(ref_fn, hidden, weight)
    with gk.force_backend("chunked"):
        ours = grads(ours_fn, hidden, weight)
    return [((o.double() - t).abs().max().item(), (f.double() - t).abs().max().item())
            for o, f, t in zip(ours, torch32, truth)]


def check(pairs):
    for name, (ours, torch32) in zip(["d hidden", "d weight"], pairs):
        assert ours <= 2.0 * torch32 + 1e-9, (name, ours, torch32)


@pytest.mark.parametrize("three_pass", ["1", "0"])
@pytest.mark.parametrize("temperature", [1.0, 0.01])
@pytest.mark.parametrize("V", [64, 4096])
def test_grpo_loss_at_dominated_rows(monkeypatch, three_pass, temperature, V):
    """fused_linear_grpo_loss (dapo, beta = 0.04) on both routes (the four-pass backward's fast
    mode; the general mode, with an entropy term, is selective_logprobs' below)."""
    monkeypatch.setenv("GRPO_KERNELS_THREE_PASS", three_pass)
    hidden, weight, ids = dominated_head(V, temperature)
    adv = torch.tensor([1.0, -0.7])
    with torch.no_grad():
        logp = reference.selective_logprobs(hidden.double(), weight.double(), ids,
                                            temperature=temperature).float()
    ref_logps = logp + 0.1
    kw = dict(loss_type="dapo", beta=0.04, temperature=temperature, ref_logps=ref_logps)
    check(errors(lambda h, w: gk.fused_linear_grpo_loss(h, w, ids, adv, **kw)[0],
                 lambda h, w: reference.fused_linear_grpo_loss(h, w, ids, adv, **kw)[0],
                 hidden, weight))


@pytest.mark.parametrize("temperature", [1.0, 0.01])
@pytest.mark.parametrize("V,entropy", [(64, False), (4096, False), (64, True)])
def test_selective_logprobs_at_dominated_rows(temperature, V, entropy):
    """selective_logprobs' backward (the four-pass route always), g_logp of either sign and of
    small magnitude (as a token-mean loss gives), with and without an entropy gradient."""
    hidden, weight, ids = dominated_head(V, temperature)
    g = torch.Generator().manual_seed(7)
    g_logp = torch.randn(ids.shape, generator=g) * 1e-3
    g_ent = torch.randn(ids.shape, generator=g) * 1e-3

    def loss(fn):
        def call(h, w):
            out = fn(h, w, ids, temperature=temperature, return_entropy=entropy)
            if not entropy:
                return (out * g_logp).sum()
            return (out[0] * g_logp).sum() + (out[1] * g_ent).sum()
        return call

    check(errors(loss(gk.selective_logprobs), loss(reference.selective_logprobs),
                 hidden, weight))
