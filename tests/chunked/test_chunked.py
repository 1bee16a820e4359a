"""The chunked PyTorch path (grpo_kernels/chunked) against a float64 truth.

Half inputs: logits must accumulate in float32 (docs/semantics.md), so the chunked path's error is
bounded by PyTorch's float32 error on the same half values, not by half precision; the bf16
reference (which rounds logits to bf16) is the positive control that this bound can fail.
Mixed head precision (float32 weight, half hidden) gives the fp32 head's logits of the hidden
states as given, and each gradient in its input's dtype.
"""

from __future__ import annotations

import pytest
import torch
from helpers import leaf, make_head, scaled_err

import grpo_kernels as gk
from benchmarks.measure import LiveStorageTracker
from grpo_kernels import chunked, reference
from grpo_kernels.chunked import linear_launchers
from grpo_kernels.chunked.tiles import LN2

pytestmark = pytest.mark.usefixtures("one_thread")
HALF = [torch.bfloat16, torch.float16]


def _coefficients(N, seed, entropy=True, masked=True):
    """g_logp, g_entropy [N] with every third token's gradient zero (padding)."""
    g = torch.Generator().manual_seed(seed)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    if masked:
        g_logp[::3], g_ent[::3] = 0.0, 0.0
    return g_logp, g_ent if entropy else None


def _truth(hidden, weight, bias, ids, temperature, g_logp, g_ent):
    """float64 on exactly the given values: (logp, entropy, d hidden, d weight, d bias)."""
    h, w = leaf(hidden, torch.float64), leaf(weight, torch.float64)
    b = leaf(bias, torch.float64)
    z = (h @ w.T + (0.0 if b is None else b)) / temperature
    log_p = z.log_softmax(-1)
    logp = log_p.gather(1, ids[:, None]).squeeze(1)
    ent = -(log_p.exp() * log_p).sum(-1)
    loss = (g_logp.double() * logp).sum()
    if g_ent is not None:
        loss = loss + (g_ent.double() * ent).sum()
    loss.backward()
    return logp, ent, h.grad, w.grad, None if b is None else b.grad


def _chunked(hidden, weight, bias, ids, temperature, g_logp, g_ent, chunk_elements=None,
             keep=False, lse_sum=None):
    """Forward then backward; with `keep`, the backward starts from the forward's kept logits
    tile (when it fits one tile) instead of recomputing it; lse_sum (float32 [N]) is written by
    the forward and read by the backward."""
    kept = {} if keep else None
    logp, ent, lse = chunked.linear_logprob_forward(hidden, weight, bias, ids, temperature,
                                                    chunk_elements=chunk_elements, keep=kept,
                                                    lse_sum=lse_sum)
    grads = chunked.linear_logprob_backward(hidden, weight, bias, ids, lse, ent, g_logp, g_ent,
                                            temperature, chunk_elements=chunk_elements,
                                            kept=kept, lse_sum=lse_sum)
    assert not kept  # taken by the backward (or never filled)
    return (logp, ent, *grads)


def _head(dtype, weight_dtype=None, bias=False, N=96, D=32, V=300, seed=0):
    hidden, weight, b, ids = make_head(1, N, D, V, torch.float32, "cpu", seed=seed, bias=bias,
                                       scale=4.0)
    wdt = weight_dtype or dtype
    return (hidden[0].to(dtype), weight.to(wdt), None if b is None else b.to(wdt), ids[0])


# every [rows, cols] tiling: one tile, several vocabulary tiles, several token blocks too
@pytest.mark.parametrize("chunk_elements,keep", [(None, False), (None, True), (7 * 96, False),
                                                 (50, False)])
@pytest.mark.parametrize("bias,temperature,entropy", [(False, 1.0, False), (False, 0.7, False),
                                                      (True, 0.7, True), (False, 1.0, True)])
def test_float32_matches_truth(chunk_elements, keep, bias, temperature, entropy):
    """float32 inputs, forward and every gradient, with the fast (no bias, no entropy gradient)
    and the general backward, recomputing the logits or from the forward's kept tile: within a
    small multiple of float32 rounding."""
    hidden, weight, b, ids = _head(torch.float32, bias=bias)
    g_logp, g_ent = _coefficients(ids.numel(), 1, entropy)
    ours = _chunked(hidden, weight, b, ids, temperature, g_logp, g_ent, chunk_elements, keep)
    truth = _truth(hidden, weight, b, ids, temperature, g_logp, g_ent)
    for name, o, t in zip(["logp", "entropy", "d hidden", "d weight", "d bias"], ours, truth):
        assert (o is None) == (t is None), name
        if t is not None:
            assert o.dtype == torch.float32, name
            assert scaled_err(o, t) < 2e-5, name


# N > 256 tokens, so that tiles come in several row blocks: 2·256·300 elements give forward tiles
# that span the vocabulary in three row blocks (256, 256, 88); 256·300 give two vocabulary tiles
# × three row blocks forward, and whole-row tiles in two row blocks for the fast backward.
@pytest.mark.parametrize("chunk_elements", [2 * 256 * 300, 256 * 300])
@pytest.mark.parametrize("bias,temperature,entropy", [(False, 1.0, False), (True, 0.7, True)])
def test_float32_row_blocks_match_truth(chunk_elements, bias, temperature, entropy):
    """Several token blocks per tile, with tiles that span the vocabulary and with vocabulary
    tiles, fast and general backward: within a small multiple of float32 rounding."""
    hidden, weight, b, ids = _head(torch.float32, bias=bias, N=600, D=32, V=300, seed=11)
    g_logp, g_ent = _coefficients(ids.numel(), 12, entropy)
    ours = _chunked(hidden, weight, b, ids, temperature, g_logp, g_ent, chunk_elements)
    truth = _truth(hidden, weight, b, ids, temperature, g_logp, g_ent)
    for name, o, t in zip(["logp", "entropy", "d hidden", "d weight", "d bias"], ours, truth):
        assert (o is None) == (t is None), name
        if t is not None:
            assert scaled_err(o, t) < 2e-5, name


@pytest.mark.parametrize("chunk_elements,N", [(None, 96), (7 * 96, 96), (256 * 300, 600)])
@pytest.mark.parametrize("bias,temperature,entropy", [(False, 1.0, False), (True, 0.7, True),
                                                      (False, 1.0, True)])
def test_lse_sum_matches_truth(chunk_elements, N, bias, temperature, entropy):
    """The forward's lse_sum is S = Σ 2^(z - r) of each row, r = lse·log2(e) from the float32
    lse it returns, on whole rows, vocabulary tiles and row blocks; the backward that reads p
    as 2^(z - r) / S (fast and general modes) matches the float64 truth as the others do."""
    hidden, weight, b, ids = _head(torch.float32, bias=bias, N=N, seed=N)
    g_logp, g_ent = _coefficients(ids.numel(), 3, entropy)
    lse_sum = torch.full((N,), float("nan"))
    ours = _chunked(hidden, weight, b, ids, temperature, g_logp, g_ent, chunk_elements,
                    lse_sum=lse_sum)
    _, _, lse = chunked.linear_logprob_forward(hidden, weight, b, ids, temperature)
    z = (hidden.double() @ weight.double().T + (0.0 if b is None else b.double())) / temperature
    r = (lse * (1.0 / torch.log(torch.tensor(2.0)))).double()  # float32 lse·log2(e)
    want = torch.exp2(z / torch.log(torch.tensor(2.0, dtype=torch.float64)) - r[:, None]).sum(1)
    assert (lse_sum.double() - want).abs().max() / want.abs().max() < 1e-5
    truth = _truth(hidden, weight, b, ids, temperature, g_logp, g_ent)
    for name, o, t in zip(["logp", "entropy", "d hidden", "d weight", "d bias"], ours, truth):
        if t is not None:
            assert scaled_err(o, t) < 2e-5, name


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("entropy,keep", [(False, False), (True, False), (True, True)])
def test_half_logits_accumulate_in_float32(dtype, entropy, keep):
    """With bf16/fp16 inputs, logp and entropy are as accurate as float32
    arithmetic on the same half values; the bf16/fp16 reference, which rounds the logits to the
    input dtype, is far outside that bound (so the bound can fail)."""
    hidden, weight, b, ids = _head(dtype, bias=True)
    g_logp, g_ent = _coefficients(ids.numel(), 2, entropy)
    truth = _truth(hidden, weight, b, ids, 0.8, g_logp, g_ent)
    upcast = [x.float() for x in (hidden, weight, b)]
    fp32 = _chunked(*upcast, ids, 0.8, g_logp, g_ent)  # PyTorch float32 on the same values
    ours = _chunked(hidden, weight, b, ids, 0.8, g_logp, g_ent, keep=keep)
    rounded, rounded_ent = reference.selective_logprobs(hidden, weight, ids, b, temperature=0.8,
                                                        return_entropy=True)
    for i, name in enumerate(["logp", "entropy"]):
        bound = 4 * scaled_err(fp32[i], truth[i]) + 1e-6
        assert ours[i].dtype == torch.float32
        assert scaled_err(ours[i], truth[i]) <= bound, name
        control = rounded if i == 0 else rounded_ent
        assert scaled_err(control, truth[i]) > 10 * bound, name  # positive control
    # gradients: float32 arithmetic, rounded once to the input dtype at the end
    eps = torch.finfo(dtype).eps
    for name, o, f, t in zip(["d hidden", "d weight", "d bias"], ours[2:], fp32[2:], truth[2:]):
        assert o.dtype == dtype, name
        assert scaled_err(o, t) <= eps + 4 * scaled_err(f, t), name


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_head_precision(dtype):
    """float32 weight and bias with half hidden: the fp32 head applied to the hidden states as
    given; d hidden in the hidden's dtype, d weight and d bias in float32 at float32 accuracy."""
    hidden, weight, b, ids = _head(dtype, weight_dtype=torch.float32, bias=True, seed=3)
    g_logp, g_ent = _coefficients(ids.numel(), 4)
    ours = _chunked(hidden, weight, b, ids, 1.0, g_logp, g_ent, chunk_elements=40 * 96)
    truth = _truth(hidden, weight, b, ids, 1.0, g_logp, g_ent)
    for name, o, t in zip(["logp", "entropy", "d weight", "d bias"], ours[:2] + ours[3:],
                          truth[:2] + truth[3:]):
        assert o.dtype == torch.float32, name
        assert scaled_err(o, t) < 2e-5, name
    assert ours[2].dtype == dtype
    assert scaled_err(ours[2], truth[2]) <= torch.finfo(dtype).eps + 2e-5


def test_forward_keeps_its_tile_only_when_the_logits_fit_one(monkeypatch):
    """keep: filled with z - m [N, V] and log2 Σ 2^(z - m) [N] (log2 units) when the logits fit
    one tile within KEEP_ELEMENTS; left empty when the forward needs several tiles or N·V exceeds
    the budget.
    A backward given the tile is at least as close to the float64 truth as the recomputing
    backward (which reads p through the lse in nats) and takes the tile (overwritten) out of
    the dict."""
    hidden, weight, b, ids = _head(torch.float32, bias=True, N=40, D=16, V=64, seed=9)
    kept = {}
    logp, ent, lse = chunked.linear_logprob_forward(hidden, weight, b, ids, 0.7, keep=kept)
    assert kept["tile"].shape == (40, 64) and kept["log_sum"].shape == (40,)
    log2_p = kept["tile"] - kept["log_sum"][:, None]
    truth = torch.log_softmax((hidden.double() @ weight.double().T + b.double()) / 0.7, -1)
    assert scaled_err(log2_p * LN2, truth) < 1e-6
    g_logp, g_ent = _coefficients(40, 10)
    args = (hidden, weight, b, ids, lse, ent, g_logp, g_ent, 0.7)
    from_tile = chunked.linear_logprob_backward(*args, kept=kept)
    assert not kept
    recomputed = chunked.linear_logprob_backward(*args)
    exact = _truth(hidden, weight, b, ids, 0.7, g_logp, g_ent)[2:]
    for a, r, t in zip(from_tile, recomputed, exact):
        assert scaled_err(r, t) < 2e-5
        assert scaled_err(a, t) <= scaled_err(r, t) + 1e-7
    for chunk_elements in (40 * 16, None):
        if chunk_elements is None:  # one tile, but above the keep budget
            monkeypatch.setattr(linear_launchers, "KEEP_ELEMENTS", 40 * 64 - 1)
        kept = {}
        chunked.linear_logprob_forward(hidden, weight, b, ids, 0.7, chunk_elements, keep=kept)
        assert kept == {}


def test_fully_masked_and_empty():
    hidden, weight, b, ids = _head(torch.float32, bias=True, N=8)
    lse = torch.zeros(8)
    zeros = torch.zeros(8)
    dh, dw, db = chunked.linear_logprob_backward(hidden, weight, b, ids, lse, lse, zeros, None,
                                                 1.0)
    assert not dh.any() and not dw.any() and not db.any()
    out = chunked.linear_logprob_forward(hidden[:0], weight, b, ids[:0], 1.0)
    assert all(x.shape == (0,) for x in out)


def test_public_api_on_the_chunked_backend_in_bf16():
    """gk.selective_logprobs forced onto the chunked backend: bf16 logp at float32 accuracy."""
    hidden, weight, _, ids = _head(torch.bfloat16, seed=6)
    with gk.force_backend("chunked"):
        ours = gk.selective_logprobs(hidden, weight, ids)
    truth = _truth(hidden, weight, None, ids, 1.0, torch.zeros(ids.numel()), None)[0]
    assert ours.dtype == torch.float32 and scaled_err(ours, truth) < 2e-6


def test_linear_head_never_holds_logits():
    """Live tensor storage during forward + backward stays a small fraction of one [N, V]
    float32 logits tensor: the tiles bound it, not N·V."""
    N, D, V = 512, 16, 2048
    hidden, weight, _, ids = make_head(1, N, D, V, torch.float32, "cpu", seed=7)
    h, w = leaf(hidden[0]), leaf(weight)
    g_logp, _ = _coefficients(N, 8, entropy=False)
    with LiveStorageTracker() as tracker:
        _chunked(h.detach(), w.detach(), None, ids[0], 1.0, g_logp, None,
                 chunk_elements=2**15)
    assert tracker.peak < N * V * 4 / 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
def test_logits_path_matches_truth(dtype, inplace):
    """Logits input [B, T, V] (a sliced, non-contiguous view), temperature, entropy gradient and
    a fully masked sequence; the gradient in the logits' dtype, optionally over the logits,
    from the lse or from the forward's kept statistics."""
    g = torch.Generator().manual_seed(9)
    full = (torch.randn(3, 9, 70, generator=g) * 3).to(dtype)
    logits = full[:, 1:8]  # [3, 7, 70], non-contiguous
    ids = torch.randint(0, 70, (21,), generator=g)
    g_logp, g_ent = _coefficients(21, 10)
    g_logp[7:14], g_ent[7:14] = 0.0, 0.0  # sequence 1 fully masked
    x = leaf(logits, torch.float64)
    log_p = (x.reshape(21, 70) / 0.7).log_softmax(-1)
    t_logp = log_p.gather(1, ids[:, None]).squeeze(1)
    t_ent = -(log_p.exp() * log_p).sum(-1)
    ((g_logp.double() * t_logp).sum() + (g_ent.double() * t_ent).sum()).backward()
    # chunk_elements small enough for pieces of one sequence and for whole sequences
    # the backward reads p through the lse, or from the forward's kept statistics (taken out)
    for ce, keep in [(None, False), (3 * 70, False), (20 * 70, False), (None, True),
                     (3 * 70, True)]:
        kept = {} if keep else None
        lp, en, lse = chunked.logits_logprob_forward(logits, ids, 0.7, chunk_elements=ce,
                                                     keep=kept)
        assert scaled_err(lp, t_logp) < 1e-6 and scaled_err(en, t_ent) < 1e-6
        assert kept is None or sorted(kept) == ["max", "sum"]
        target = logits.clone() if inplace else None
        dx = chunked.logits_logprob_backward(logits, ids, lse, en, g_logp, g_ent, 0.7,
                                             out=target, chunk_elements=ce, kept=kept)
        assert not kept
        assert dx.dtype == dtype and (target is None or dx is target)
        assert scaled_err(dx, x.grad) <= torch.finfo(dtype).eps + 1e-5
        assert not dx[1].any()
