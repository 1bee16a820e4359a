"""Our loss semantics against TRL 1.16's own `GRPOTrainer._compute_loss` (docs/semantics.md).

TRL's method is run unchanged on a stand-in trainer object whose log-prob scoring is a float64
linear head, so what is compared is exactly TRL's loss math, aggregation and metrics: one process,
no gradient accumulation, steps_per_generation = 1 (then TRL's dapo/cispo normalizer is
num_items_in_batch). Against it: the reference (float64: agreement to rounding) and the public
`fused_linear_grpo_loss` (float32) on the chunked PyTorch backend and on the Triton kernels (in
Triton's interpreter on CPU), over every loss type × token/sequence level × delta × beta ×
entropy bonus. The batch has a fully masked sequence, padding with finite junk in the old/ref
log-probs, and num_items_in_batch != the micro-batch's token count, so each of the four places
where an older reading of the spec differed from TRL shows.
"""

import itertools

import pytest
import torch
from helpers import triton_unavailable
from trl_compute_loss import assert_close_to_trl, trl_loss

from grpo_kernels import LOSS_TYPES, force_backend, fused_linear_grpo_loss, reference
from grpo_kernels.reference import logprobs_from_logits

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

B, T, D, V = 5, 6, 16, 48
TEMPERATURE = 0.7
# delta below 1 + epsilon_high, so that the capped and the uncapped ratio flag differently
DELTA = 1.1
VARIANTS = list(itertools.product([None, DELTA], [0.0, 0.04], [0.0, 0.1]))  # delta, beta, coef


def make_batch(seed=2):
    """hidden [B, T, D], weight [V, D] (float64), ids, mask with padding and a fully masked row,
    advantages [B] of both signs, old/ref log-probs near the policy's (junk on padding)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([6, 3, 0, 5, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    advantages = torch.tensor([0.9, -1.3, 0.4, -0.6, 1.1], dtype=torch.float64)
    with torch.no_grad():
        logp = logprobs_from_logits(hidden @ weight.T, ids, temperature=TEMPERATURE)
    noise = lambda: 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(hidden=hidden, weight=weight, ids=ids, mask=mask, advantages=advantages,
                old=logp + noise(), ref=logp + noise(),
                num_items=mask.sum() * 2)  # as if the generation batch had two micro-batches


def hyper(loss_type, level, delta, beta, entropy_coef):
    return dict(loss_type=loss_type, importance_sampling_level=level, delta=delta, beta=beta,
                entropy_coef=entropy_coef, epsilon_low=0.2,
                epsilon_high=1.5 if loss_type == "cispo" else 0.28, temperature=TEMPERATURE,
                max_completion_length=T)


def our_loss(fn, batch, hp, dtype):
    hidden = batch["hidden"].to(dtype, copy=True).requires_grad_(True)
    weight = batch["weight"].to(dtype, copy=True).requires_grad_(True)
    cast = lambda x: x.to(dtype)  # noqa: E731
    loss, metrics = fn(hidden, weight, batch["ids"], cast(batch["advantages"]),
                       cast(batch["mask"]), cast(batch["old"]), cast(batch["ref"]),
                       num_items_in_batch=cast(batch["num_items"]), **hp)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, {k: v.item() for k, v in metrics.items()}


def assert_matches_trl(got, want, tol, label):
    # TRL also logs per-sequence extremes and policy_loss, which the core API does not return
    assert_close_to_trl(got, want, tol, label)
    assert {"entropy"} <= got[3].keys()




IMPLEMENTATIONS = {
    # name: (function, dtype, backend, tolerance against TRL in float64); the loss inputs
    # (advantages, old/ref log-probs) are float32 even in the float64 reference
    "reference-f64": (reference.fused_linear_grpo_loss, torch.float64, None, 1e-6),
    "chunked-f32": (fused_linear_grpo_loss, torch.float32, "chunked", 2e-5),
    "triton-f32": (fused_linear_grpo_loss, torch.float32, "triton", 2e-5),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_grads_and_metrics_match_trl(loss_type, level, impl):
    fn, dtype, backend, tol = IMPLEMENTATIONS[impl]
    if backend == "triton" and (why := triton_unavailable()) is not None:
        pytest.skip(why)
    batch = make_batch()
    for delta, beta, coef in VARIANTS:
        hp = hyper(loss_type, level, delta, beta, coef)
        label = f"{impl} {hp}"
        with force_backend(backend):
            got = our_loss(fn, batch, hp, dtype)
        assert_matches_trl(got, trl_loss(batch, hp), tol, label)


def test_each_divergence_is_visible_in_this_batch():
    """Positive control: the batch tells the old readings from TRL's (so the parity above is not
    vacuous): luspo's weight, the entropy divisor, per-sequence clip means and the delta cap."""
    batch = make_batch()
    mask = batch["mask"]
    # luspo: Σ mask·ℓ / B differs from ℓ·len_b / (B·T) summed over all positions
    assert not torch.equal(mask / B, (mask.sum(-1, keepdim=True) / (B * T)).expand(B, T))
    # entropy bonus: the micro-batch's token count is not num_items_in_batch
    assert batch["num_items"] != mask.sum()
    # sequence-level clip means: a fully masked sequence, unequal lengths, some flags set
    assert (mask.sum(-1) == 0).any() and len(set(mask.sum(-1).tolist())) > 2
    seq = trl_loss(batch, hyper("grpo", "sequence", None, 0.0, 0.0))[3]
    assert seq["clip_ratio/region_mean"] > 0
    # delta: TRL's high_mean differs between the capped and the uncapped ratio on this batch
    hp = hyper("grpo", "token", DELTA, 0.0, 0.0)
    capped = trl_loss(batch, hp)[3]["clip_ratio/high_mean"]
    uncapped = trl_loss(batch, {**hp, "delta": None})[3]["clip_ratio/high_mean"]
    assert capped != uncapped
