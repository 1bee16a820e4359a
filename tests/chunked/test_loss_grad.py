"""The gradient in the forward (grpo_kernels/chunked/loss_grad.py) against a float64 truth and
against the four-pass launchers (forward, then a backward that recomputes the logits).

The loss is L = Σ_n f_n(logp_n) + Σ_n g_H,n·H_n over the listed rows, with a non-linear f_n
(a·logp + q·logp²), so the launcher's callback must see each chunk's log-probs before their
gradient is formed."""

from __future__ import annotations

import pytest
import torch
from helpers import leaf, make_head, scaled_err

from benchmarks.measure import LiveStorageTracker
from grpo_kernels.chunked import blocks
from grpo_kernels.chunked import launchers as chunked
from grpo_kernels.chunked.loss_grad import linear_loss_grad, whole_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(N=60, D=24, V=97, bias=False, seed=0, dtype=torch.float32, weight_dtype=None):
    hidden, weight, b, ids = make_head(1, N, D, V, torch.float32, "cpu", seed=seed, bias=bias,
                                       scale=4.0)
    g = torch.Generator().manual_seed(seed + 5)
    a, q, gh = torch.randn(N, generator=g), 0.1 * torch.randn(N, generator=g), torch.randn(N,
                                                                                    generator=g)
    wdt = weight_dtype or dtype
    return (hidden[0].to(dtype), weight.to(wdt), None if b is None else b.to(wdt), ids[0],
            a, q, gh)


def _callback(a, q, rows, seen):
    """d_logp of f_n = a·logp + q·logp² for the computed rows (`rows` order); records calls."""
    def d_logp(r0, r, logp):
        idx = torch.arange(a.numel()) if rows is None else rows
        seen.append((r0, r))
        sel = idx[r0:r0 + r]
        return a[sel] + 2 * q[sel] * logp
    return d_logp


def _truth(hidden, weight, bias, ids, temperature, a, q, gh, rows, scale=1.0):
    h, w, b = (leaf(x, torch.float64) for x in (hidden, weight, bias))
    z = (h @ w.T + (0.0 if b is None else b)) * scale / temperature
    log_p = z.log_softmax(-1)
    logp = log_p.gather(1, ids[:, None]).squeeze(1)
    ent = -(log_p.exp() * log_p).sum(-1)
    sel = torch.arange(ids.numel()) if rows is None else rows
    loss = (a.double() * logp + q.double() * logp**2)[sel].sum()
    if gh is not None:
        loss = loss + (gh.double() * ent)[sel].sum()
    loss.backward()
    return logp[sel], ent[sel], h.grad, w.grad, None if b is None else b.grad


# one chunk and several; every row or every third one missing; with and without bias, entropy
# coefficients, temperature and a logit scale
@pytest.mark.parametrize("chunk_rows", [None, 7])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("bias,entropy,temperature,scale", [
    (False, False, 1.0, None), (True, False, 0.7, None), (False, True, 0.7, 1.3),
    (True, True, 1.0, -0.8)])
def test_float32_matches_truth(chunk_rows, masked, bias, entropy, temperature, scale):
    hidden, weight, b, ids, a, q, gh = _problem(bias=bias, seed=1)
    rows = torch.tensor([n for n in range(60) if n % 3]) if masked else None
    seen = []
    out = linear_loss_grad(hidden, weight, b, ids, temperature, _callback(a, q, rows, seen),
                           gh if entropy else None, rows, chunk_rows=chunk_rows,
                           logit_scale=scale)
    truth = _truth(hidden, weight, b, ids, temperature, a, q, gh if entropy else None, rows,
                   1.0 if scale is None else scale)
    Na = 60 if rows is None else rows.numel()
    step = chunk_rows or Na
    assert seen == [(r0, min(step, Na - r0)) for r0 in range(0, Na, step)]
    ours = (out.logp, out.entropy, out.d_hidden, out.d_weight, out.d_bias)
    for name, o, t in zip(["logp", "entropy", "d hidden", "d weight", "d bias"], ours, truth):
        if t is None:
            assert o is None, name
            continue
        assert o.dtype == torch.float32 and scaled_err(o, t) < 2e-6, name
    if rows is not None:  # rows not computed: no gradient
        assert not out.d_hidden[::3].any()
    sel = slice(None) if rows is None else rows
    torch.testing.assert_close(out.coef, a[sel] + 2 * q[sel] * truth[0].float(), rtol=0,
                               atol=1e-5)


@pytest.mark.parametrize("entropy", [False, True])
def test_same_gradients_as_the_four_pass_launchers(entropy):
    """Given the same per-token coefficients, the chunked forward + recomputing backward give
    the same log-probs, entropies and gradients to float32 rounding."""
    hidden, weight, b, ids, a, _, gh = _problem(N=80, V=300, bias=True, seed=2)
    a[::4] = 0.0
    gh = gh if entropy else None
    if entropy:
        gh[::4] = 0.0
    out = linear_loss_grad(hidden, weight, b, ids, 0.8, lambda r0, r, lp: a[r0:r0 + r], gh,
                           chunk_rows=16)
    logp, ent, lse = chunked.linear_logprob_forward(hidden, weight, b, ids, 0.8)
    grads = chunked.linear_logprob_backward(hidden, weight, b, ids, lse, ent, a, gh, 0.8,
                                            chunk_elements=40 * 300)
    for o, t in zip((out.logp, out.entropy, out.lse, out.d_hidden, out.d_weight, out.d_bias),
                    (logp, ent, lse, *grads)):
        assert scaled_err(o, t) < 1e-6


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True),
                                   (False, False, False)])
def test_partial_needs(needs):
    """A frozen head gives no d weight (its GEMM is skipped); frozen hidden states no d hidden."""
    hidden, weight, b, ids, a, q, _ = _problem(bias=True, seed=3)
    out = linear_loss_grad(hidden, weight, b, ids, 1.0, _callback(a, q, None, []), None,
                           needs=needs)
    truth = _truth(hidden, weight, b, ids, 1.0, a, q, None, None)
    for o, t, need in zip((out.d_hidden, out.d_weight, out.d_bias), truth[2:], needs):
        assert (o is None) if not need else scaled_err(o, t) < 2e-6
    assert scaled_err(out.logp, truth[0]) < 2e-6


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                                (torch.bfloat16, torch.float32)])
def test_half_inputs_accumulate_in_float32(dtype, weight_dtype):
    """Half hidden (and weight): logits, statistics and gradients in float32, each gradient
    returned in its input's dtype, within one rounding of that dtype of the float64 truth on
    the same half values."""
    hidden, weight, b, ids, a, q, gh = _problem(bias=True, seed=4, dtype=dtype,
                                                weight_dtype=weight_dtype)
    out = linear_loss_grad(hidden, weight, b, ids, 0.7, _callback(a, q, None, []), gh,
                           chunk_rows=16)
    truth = _truth(hidden, weight, b, ids, 0.7, a, q, gh, None)
    assert scaled_err(out.logp, truth[0]) < 2e-5 and scaled_err(out.entropy, truth[1]) < 2e-5
    for o, t, x in zip((out.d_hidden, out.d_weight, out.d_bias), truth[2:], (hidden, weight, b)):
        assert o.dtype == x.dtype
        assert scaled_err(o, t) <= torch.finfo(x.dtype).eps + 2e-5


def test_no_rows_and_no_tokens():
    hidden, weight, b, ids, a, q, _ = _problem(bias=True, seed=5)
    for rows, h, t in ((torch.zeros(0, dtype=torch.long), hidden, ids),
                       (None, hidden[:0], ids[:0])):
        out = linear_loss_grad(h, weight, b, t, 1.0, _callback(a, q, rows, []), None, rows)
        assert out.logp.shape == (0,) and not out.d_hidden.any()
        assert out.d_hidden.shape == h.shape
        assert not out.d_weight.any() and not out.d_bias.any()


def test_whole_rows_within_the_budget(monkeypatch):
    """Chunks hold whole rows, two [rows, V] buffers within the element budget and at least
    min(n, TILE_ROWS) rows; otherwise None (the caller keeps the four-pass path), and the
    launcher refuses."""
    budget = blocks.TILE_ELEMENTS // 2
    assert whole_rows(4096, 4096) == budget // 4096
    assert whole_rows(1024, budget // blocks.TILE_ROWS) == blocks.TILE_ROWS
    assert whole_rows(1024, budget // blocks.TILE_ROWS + 1) is None
    assert whole_rows(10, 151936) == 10  # few tokens: whole rows of a large vocabulary fit
    hidden, weight, b, ids, a, q, _ = _problem(seed=6)
    with pytest.raises(ValueError, match="do not fit"):
        linear_loss_grad(hidden, weight, b, ids, 1.0, _callback(a, q, None, []),
                         chunk_elements=2 * 97 * 10)


def test_memory_is_two_chunks_not_the_logits():
    """Live storage stays near two [rows, V] chunks plus the gradients: far below [N, V]."""
    N, D, V = 8192, 16, 2048
    hidden, weight, _, ids = make_head(1, N, D, V, torch.float32, "cpu", seed=7)
    a = torch.randn(N)
    assert whole_rows(N, V, 2**20) == 256
    with LiveStorageTracker() as tracker:
        linear_loss_grad(hidden[0], weight, None, ids[0], 1.0, lambda r0, r, lp: a[r0:r0 + r],
                         chunk_elements=2**20)
    assert tracker.peak < N * V * 4 / 8
