"""The two loss types beyond TRL's, gmpo and dppo, on every path:

- the formula: `grpo_math` against an independent float64 transcription of each paper's
  objective (GMPO: the geometric mean of pessimistically clipped token ratios; DPPO-Binary-TV:
  the truncated, detached ratio times a trust-region mask on the probability change), loss and
  d loss / d logp, with tokens on both sides of every trust-region edge;
- the kernels: `fused_linear_grpo_loss` on the Triton backend (dppo's epilogue; gmpo through
  the per-sequence route) and the chunked path against the float64 reference, loss, metrics and
  gradients (the check of test_fused_linear_grpo);
- packed batches equal padded ones; the refusals (sequence level, TRL's trainer).
"""

import pytest
import torch
from test_fused_linear_grpo import BACKENDS, check

import grpo_kernels as gk
from grpo_kernels.grpo_math import policy_loss
from grpo_kernels.params import GRPOParams
from grpo_kernels.validation import LossInputs

NEW_TYPES = ["gmpo", "dppo"]


def crafted(seed=0, B=4, T=9):
    """logp, old [B, T] float64 with probabilities up to ~0.9 and moves of ±0.5 in log space
    (so TV changes and log-ratios cross ±0.2), a padded tail, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.85 + 0.05)
    old = (logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 6:] = 0
    mask[2, 3:] = 0
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)[:B].unsqueeze(1)
    return logp, old, mask, adv


def gmpo_truth(logp, old, mask, adv, eps_low, eps_high):
    """GMPO (Zhao et al., 2025): per sequence, -Â·exp(mean_t of the pessimistic clipped
    log-ratio); the loss is the mean over sequences."""
    losses = []
    for b in range(logp.shape[0]):
        keep = mask[b].bool()
        r = (logp[b] - old[b])[keep]
        a = adv[b, 0]
        clipped = r.clamp(-eps_low, eps_high)
        m = torch.maximum(r, clipped) if a < 0 else torch.minimum(r, clipped)
        mean = m.mean() if keep.any() else r.sum() * 0
        losses.append(-a * torch.exp(mean))
    return torch.stack(losses).mean()


def dppo_truth(logp, old, mask, adv, eps_low, eps_high, cap):
    """DPPO-Binary-TV: per token -A·sg(min(w, cap))·[trust region]·logp, the region
    p - p_old <= eps_high for A > 0 and >= -eps_low otherwise; summed over the real tokens and
    divided by their count (the step's token count: dapo's normalization)."""
    w = torch.exp(logp - old).detach()
    change = (torch.exp(logp) - torch.exp(old)).detach()
    A = adv.expand_as(logp)
    inside = torch.where(A > 0, change <= eps_high, change >= -eps_low).to(logp.dtype)
    coef = w if cap is None else w.clamp(max=cap)
    per_token = -A * coef * inside * logp
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_formula_against_an_independent_transcription(loss_type, seed):
    logp, old, mask, adv = crafted(seed)
    eps_low, eps_high, cap = 0.2, 0.28, (1.5 if loss_type == "dppo" else None)
    params = GRPOParams(loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
                        delta=cap)
    x = logp.clone().requires_grad_(True)
    inputs = LossInputs(mask=mask, advantages=adv, old_logps=old, ref_logps=None,
                        importance_sampling_ratio=None, num_items_in_batch=None)
    ours = policy_loss(x, inputs, params).loss
    (g_ours,) = torch.autograd.grad(ours, x)
    y = logp.clone().requires_grad_(True)
    if loss_type == "gmpo":
        truth = gmpo_truth(y, old, mask, adv, eps_low, eps_high)
    else:
        truth = dppo_truth(y, old, mask, adv, eps_low, eps_high, cap)
    (g_truth,) = torch.autograd.grad(truth, y)
    torch.testing.assert_close(ours, truth, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_truth, rtol=1e-12, atol=1e-12)
    # the batch reaches both sides of the trust region: not a test of the inside only
    w = torch.exp(logp - old)[mask.bool()]
    if loss_type == "gmpo":
        r = torch.log(w)
        assert bool((r > eps_high).any()) and bool((r < -eps_low).any())
    else:
        change = (torch.exp(logp) - torch.exp(old))[mask.bool()]
        assert bool((change > eps_high).any()) and bool((change < -eps_low).any())


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("delta", [None, 1.5])
@pytest.mark.parametrize("loss_type", NEW_TYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_against_float64(backend, loss_type, delta, beta):
    kw = dict(loss_type=loss_type, beta=beta, delta=delta, epsilon_high=0.28, temperature=0.7)
    check(backend, torch.float32, (3, 47, 31, 123), kw, bias=True, seed=3)


@pytest.mark.parametrize("loss_type", NEW_TYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_ratio_and_token_advantages(backend, loss_type):
    """A per-token rollout ratio (gmpo: its geometric mean per sequence) and per-token
    advantages (gmpo: their masked mean per sequence)."""
    check(backend, torch.float32, (3, 29, 31, 123),
          dict(loss_type=loss_type, beta=0.04, epsilon_high=0.28), bias=False, seed=4,
          token_adv=True)


@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_packed_equals_padded(loss_type):
    torch.manual_seed(5)
    B, T, D, V = 3, 7, 16, 50
    h = torch.randn(B, T, D, dtype=torch.float64)
    w = torch.randn(V, D, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T))
    mask = (torch.arange(T) < torch.tensor([7, 3, 5])[:, None]).double()
    adv = torch.tensor([0.9, -1.2, 0.3], dtype=torch.float64)
    with torch.no_grad():
        old = gk.selective_logprobs(h, w, ids) + 0.3 * torch.randn(B, T, dtype=torch.float64)
    kw = dict(loss_type=loss_type, beta=0.0, epsilon_high=0.28)
    hp = h.clone().requires_grad_(True)
    loss_pad, met_pad = gk.fused_linear_grpo_loss(hp, w, ids, adv, mask, old, **kw)
    loss_pad.backward()
    real = mask.bool()
    hk = h.clone().requires_grad_(True)
    cu = torch.nn.functional.pad(real.sum(1).cumsum(0), (1, 0))
    loss_pk, met_pk = gk.fused_linear_grpo_loss(hk[real], w, ids[real], adv, None, old[real],
                                                cu_seqlens=cu, **kw)
    loss_pk.backward()
    torch.testing.assert_close(loss_pk, loss_pad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(hk.grad, hp.grad, rtol=1e-6, atol=1e-7)
    for k in met_pad:
        torch.testing.assert_close(met_pk[k], met_pad[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_refusals(loss_type):
    with pytest.raises(ValueError, match="importance_sampling_level 'token'"):
        GRPOParams(loss_type=loss_type, importance_sampling_level="sequence")
    if loss_type == "gmpo":
        with pytest.raises(ValueError, match="top_entropy_quantile"):
            GRPOParams(loss_type="gmpo", top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        GRPOParams(loss_type="gmpo2")


# gmpo in bf16 is left out: one token of this batch sits at its clip edge, and bf16 log-probs
# flip its (discrete) clip flag
@pytest.mark.parametrize("loss_type, dtype", [("gmpo", torch.float16), ("dppo", torch.float16),
                                              ("dppo", torch.bfloat16)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_against_float64(backend, loss_type, dtype):
    check(backend, dtype, (3, 47, 31, 123),
          dict(loss_type=loss_type, beta=0.04, delta=1.5, epsilon_high=0.28, temperature=0.7),
          bias=True, seed=1)
