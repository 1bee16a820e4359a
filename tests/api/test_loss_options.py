"""The loss options that need whole sequences or the batch (vespo, top_entropy_quantile,
off_policy_mask_threshold, use_adaptive_entropy) against TRL 1.16.

- Our functions against TRL's own `GRPOTrainer._compute_loss`, run unchanged on a stand-in
  trainer whose scoring is a float64 linear head (one process, no accumulation): loss, both
  gradients and every metric we return, on the chunked backend and, for two cases, on the
  Triton kernels (interpreter on CPU); the reference (float64 head) too.
- A positive control: each option changes the loss on this batch.
The TRL subclass against TRL's trainer with these options: tests/trl/test_trl_loss_options.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import triton_unavailable
from trl_compute_loss import assert_close_to_trl, trl_loss

from grpo_kernels import GRPOParams, force_backend, fused_linear_grpo_loss, reference
from grpo_kernels.grpo_options import EntropyController
from grpo_kernels.loss_call import takes_terms_op as _takes_terms_op
from grpo_kernels.reference import logprobs_from_logits

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

B, T, D, V = 5, 6, 16, 48
TEMPERATURE = 0.7
LENGTHS = [6, 3, 0, 5, 1]  # 15 real tokens, one fully masked sequence
# entropy quantiles whose interpolation point 14·(1 - q) is not a whole number: at a whole
# number the threshold is one token's own entropy, which TRL (float64 here) compares against its
# float32 rounding, a coin flip that says nothing about the formula
QUANTILES = (0.2, 0.45)


def make_batch(seed=3):
    """hidden, weight (float64), ids, mask, advantages of both signs, old/ref log-probs near the
    policy's, sampling log-probs that drift far (sequence 1) and little (sequence 3) from the
    policy on the two negative-advantage sequences, with one unscored (NaN) token, and rollout
    ratios (1 at padding, as TRL's)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).to(torch.float64)
    advantages = torch.tensor([0.9, -1.3, 0.4, -0.6, 1.1], dtype=torch.float64)
    with torch.no_grad():
        logp = logprobs_from_logits(hidden @ weight.T, ids, temperature=TEMPERATURE)
    noise = lambda s: s * torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    drift = torch.tensor([0.3, 0.6, 0.0, -0.2, 0.9], dtype=torch.float64)[:, None]
    sampling = (logp + drift + noise(0.05)) * mask
    sampling[1, 1] = math.nan
    isr = torch.where(mask.bool(), 0.6 + 0.8 * torch.rand(B, T, generator=g,
                                                          dtype=torch.float64), 1.0)
    return dict(hidden=hidden, weight=weight, ids=ids, mask=mask, advantages=advantages,
                old=logp + noise(0.3), ref=logp + noise(0.4), sampling=sampling, isr=isr,
                num_items=mask.sum() * 2)


def hyper(loss_type="dapo", level="token", beta=0.0, entropy_coef=0.0, **options):
    return dict(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                entropy_coef=entropy_coef, epsilon_low=0.2,
                epsilon_high=1.5 if loss_type == "cispo" else 0.28, temperature=TEMPERATURE,
                max_completion_length=T, **options)


def our_loss(fn, batch, hp, dtype, sampling=False, isr=False):
    hidden = batch["hidden"].to(dtype, copy=True).requires_grad_(True)
    weight = batch["weight"].to(dtype, copy=True).requires_grad_(True)
    cast = lambda x: x.to(dtype)  # noqa: E731
    loss, metrics = fn(hidden, weight, batch["ids"], cast(batch["advantages"]),
                       cast(batch["mask"]), cast(batch["old"]), cast(batch["ref"]),
                       num_items_in_batch=cast(batch["num_items"]),
                       sampling_logps=cast(batch["sampling"]) if sampling else None,
                       importance_sampling_ratio=cast(batch["isr"]) if isr else None, **hp)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, {k: v.item() for k, v in metrics.items()}


def assert_matches(got, want, tol, label):
    assert_close_to_trl(got, want, tol, label)
    # TRL also logs policy_loss and the per-sequence clip extremes (the TRL subclass's part)
    extra = {"policy_loss", "entropy_coef", "clip_ratio/low_min", "clip_ratio/high_max"}
    assert want[3].keys() - got[3].keys() <= extra, label


# name: (hyperparameters, with sampling log-probs, with rollout ratios)
CASES = {
    "vespo": (hyper("vespo"), False, False),
    "vespo-seq-kl-entropy": (hyper("vespo", "sequence", 0.04, 0.1), False, False),
    "vespo-rollout-ratios": (hyper("vespo", beta=0.04), False, True),
    "vespo-own-k-lambda": (hyper("vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5,
                                 vespo_k_neg=0.5, vespo_lambda_neg=4.0), False, False),
    "quantile-grpo-entropy": (hyper("grpo", entropy_coef=0.1, top_entropy_quantile=0.2),
                              False, False),
    "quantile-dapo-seq-kl": (hyper("dapo", "sequence", 0.04, 0.1, top_entropy_quantile=0.45),
                             False, False),
    "quantile-cispo-ratios": (hyper("cispo", top_entropy_quantile=0.45), False, True),
    "offpolicy-sampling": (hyper("grpo", beta=0.04, off_policy_mask_threshold=0.1), True,
                           False),
    "offpolicy-old": (hyper("luspo", "sequence", off_policy_mask_threshold=0.05), False, False),
    "offpolicy-sapo-ratios": (hyper("sapo", entropy_coef=0.1, off_policy_mask_threshold=0.1),
                              True, True),
    "all-three": (hyper("vespo", beta=0.04, entropy_coef=0.1, top_entropy_quantile=0.2,
                        off_policy_mask_threshold=0.1), True, True),
}


@pytest.mark.parametrize("case", CASES)
def test_options_match_trl_compute_loss(case):
    hp, sampling, isr = CASES[case]
    batch = make_batch()
    want = trl_loss(batch, hp, sampling, isr)
    with force_backend("torch"):
        got = our_loss(fused_linear_grpo_loss, batch, hp, torch.float32, sampling, isr)
    assert_matches(got, want, 2e-5, f"torch-f32 {case}")
    got = our_loss(reference.fused_linear_grpo_loss, batch, hp, torch.float64, sampling, isr)
    # the reference too (float64 head; its loss inputs are float32 like ours, and vespo's φ
    # amplifies their rounding, so the same tolerance)
    assert_matches(got, want, 2e-5, f"reference-f64 {case}")


@pytest.mark.parametrize("case", ["vespo-rollout-ratios", "all-three"])
def test_options_on_triton_match_trl(case):
    if (why := triton_unavailable()) is not None:
        pytest.skip(why)
    hp, sampling, isr = CASES[case]
    batch = make_batch()
    with force_backend("triton"):
        got = our_loss(fused_linear_grpo_loss, batch, hp, torch.float32, sampling, isr)
    assert_matches(got, trl_loss(batch, hp, sampling, isr), 2e-5, f"triton-f32 {case}")


def test_each_option_changes_this_batch():
    """Positive control: every option moves TRL's loss on this batch, the off-policy mask drops
    one negative-advantage sequence and keeps the other, and the quantile keeps some tokens."""
    batch = make_batch()
    base = trl_loss(batch, hyper("grpo", entropy_coef=0.1), True)[0]
    for options in (dict(top_entropy_quantile=0.2), dict(off_policy_mask_threshold=0.1)):
        assert trl_loss(batch, hyper("grpo", entropy_coef=0.1, **options), True)[0] != base
    logp = logprobs_from_logits(batch["hidden"] @ batch["weight"].T, batch["ids"],
                                temperature=TEMPERATURE)
    keep = trl.GRPOTrainer.get_off_policy_mask(batch["advantages"][:, None], logp,
                                               batch["sampling"], batch["mask"], 0.1)
    assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    # vespo's rollout ratios enter φ: with and without them the loss differs
    hp = hyper("vespo")
    assert trl_loss(batch, hp, isr=True)[0] != trl_loss(batch, hp)[0]


def test_packed_batch_equals_padded():
    batch = make_batch()
    hp = hyper("vespo", beta=0.04, entropy_coef=0.1, top_entropy_quantile=0.2,
               off_policy_mask_threshold=0.1)
    real = batch["mask"].bool()
    cu = torch.nn.functional.pad(real.sum(1).cumsum(0), (1, 0))

    def loss(sel, mask, **kw):  # sel: the tokens kept (all, or the real ones packed)
        x = {k: batch[k][sel].float() for k in ("hidden", "old", "ref", "sampling", "isr")}
        return fused_linear_grpo_loss(
            x["hidden"], batch["weight"].float(), batch["ids"][sel], batch["advantages"].float(),
            mask, x["old"], x["ref"], sampling_logps=x["sampling"],
            importance_sampling_ratio=x["isr"], num_items_in_batch=batch["num_items"].item(),
            **hp, **kw)

    with force_backend("torch"):
        padded, packed = loss(..., batch["mask"].float()), loss(real, None, cu_seqlens=cu)
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
    assert packed[1].keys() == padded[1].keys()
    for k in padded[1]:
        torch.testing.assert_close(packed[1][k], padded[1][k], rtol=1e-5, atol=1e-6)


def test_whole_sequence_options_leave_the_epilogue():
    assert _takes_terms_op("triton", GRPOParams())
    for kw in (dict(loss_type="vespo"), dict(top_entropy_quantile=0.5),
               dict(off_policy_mask_threshold=0.5), dict(importance_sampling_level="sequence")):
        assert not _takes_terms_op("triton", GRPOParams(**kw)), kw


@pytest.mark.parametrize("kw, match", [
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in"),
    (dict(top_entropy_quantile=math.nan), "top_entropy_quantile must be a finite"),
    (dict(off_policy_mask_threshold=math.inf), "off_policy_mask_threshold must be a finite"),
    (dict(vespo_k_pos=-1.0), "vespo_k_pos must be >= 0"),
    (dict(vespo_lambda_neg=0.0), "vespo_lambda_neg must be > 0"),
    (dict(loss_type="vespa"), "vespo"),
])
def test_bad_option_values_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        GRPOParams(**kw)


class TwoProcesses:
    """An accelerator of two processes as seen from rank 0: the peer sends `peer_local` (its
    per-process tensor, in the caller's own format), padded to one length like this rank's."""

    def __init__(self, peer_local):
        self.peer_local, self.pad_index = peer_local, 0.0

    def pad_across_processes(self, x, dim=0, pad_index=0.0):
        self.pad_index = pad_index
        n = max(len(x), len(self.peer_local))
        return torch.nn.functional.pad(x, (0, n - len(x)), value=pad_index)

    def gather(self, x):
        peer = self.pad_across_processes(self.peer_local, pad_index=self.pad_index)
        return torch.cat([x, peer])


def test_entropy_quantile_over_two_processes_as_trl():
    """The TRL subclass's NaN-padded gather gives TRL's threshold over both processes' tokens,
    with a peer holding more tokens than this rank (so both pad) and different entropies."""
    from grpo_kernels.grpo_options import high_entropy_mask
    from grpo_kernels.trl.bookkeeping import LossBookkeeping

    g = torch.Generator().manual_seed(5)
    ent, peer = torch.rand(3, 4, generator=g) * 3, torch.rand(5, 6, generator=g) * 3 + 0.5
    mask = (torch.rand(3, 4, generator=g) > 0.3).float()
    peer_mask = (torch.rand(5, 6, generator=g) > 0.3)
    kept = []
    for q in (0.2, 0.45, 0.9):
        trl_side = SimpleNamespace(accelerator=TwoProcesses(peer[peer_mask]))
        want = trl.GRPOTrainer.get_high_entropy_mask(trl_side, ent, mask, 1 - q)
        ours_side = SimpleNamespace(accelerator=TwoProcesses(
            torch.where(peer_mask, peer, torch.nan).reshape(-1)))
        got = high_entropy_mask(ent, mask, q, lambda x, side=ours_side: (
            LossBookkeeping._gather_entropies(side, x)))
        assert torch.equal(got.bool(), want), q
        kept.append(int(got.sum()))
    assert len(set(kept)) == 3 and 0 < max(kept) < mask.sum(), kept  # the quantile matters


def test_entropy_controller():
    c = EntropyController(entropy_target=0.5, entropy_coef_delta=0.1, entropy_coef_min=0.05,
                          entropy_coef_max=0.25)
    assert c.applied_coef(0.2, math.inf) == 0.0 and c.applied_coef(0.2, 0.5) == 0.2
    assert c.next_coef(0.2, 0.4) == 0.25 and c.next_coef(0.1, 0.6) == 0.05
    assert c.window_entropy(torch.tensor([3.0, 0.0])) == 3.0
    with pytest.raises(ValueError, match="entropy_coef_min must be <="):
        EntropyController(entropy_coef_min=2.0)
    with pytest.raises(ValueError, match="entropy_target must be a finite"):
        EntropyController(entropy_target=math.nan)


def test_entropy_quantile_of_no_token_keeps_none():
    """Packed rows with no completion token (every completion of the micro-batch masked out):
    nothing to take a quantile of, no token kept, as TRL's mask keeps none."""
    from grpo_kernels.grpo_options import high_entropy_mask

    got = high_entropy_mask(torch.empty(0), torch.empty(0), 0.5)
    assert got.shape == (0,) and got.dtype == torch.float32


@pytest.mark.parametrize("seed", range(40))
def test_nanquantile_above_torchs_limit_equals_torchs(monkeypatch, seed):
    """The written-out quantile (taken above torch's 2**24-element limit) equals
    torch.nanquantile bit for bit: random lengths, NaN shares (all NaN included) and q."""
    from grpo_kernels import grpo_options

    g = torch.Generator().manual_seed(seed)
    m = int(torch.randint(1, 300, (), generator=g))
    values = torch.randn(m, generator=g) * 4
    values[torch.rand(m, generator=g) < seed / 39] = torch.nan  # seed 39: every entry NaN
    q = (0.0, 1.0, float(torch.rand((), generator=g)))[seed % 3]
    want = torch.nanquantile(values, q)
    monkeypatch.setattr(grpo_options, "_QUANTILE_LIMIT", 0)
    got = grpo_options.nanquantile(values, q)
    assert torch.equal(got, want) or (got.isnan() and want.isnan()), (got, want)


def test_entropy_quantile_of_a_grid_above_torchs_limit():
    """A [B, T] grid of more than 2**24 entries (long completions, mostly padding): the
    threshold is the real tokens' quantile, as TRL takes it; torch's quantile would refuse."""
    from grpo_kernels.grpo_options import high_entropy_mask

    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(257, 65_536, generator=g) * 3  # 16,842,752 > 2**24 entries
    mask = torch.zeros_like(entropy)
    mask[:, :300] = 1.0  # 77,100 real tokens
    got = high_entropy_mask(entropy, mask, 0.2)
    threshold = torch.quantile(entropy[:, :300].reshape(-1), 0.8)
    want = (entropy >= threshold) & mask.bool()
    assert torch.equal(got.bool(), want) and 0 < got.sum() < mask.sum()
