"""The gradient in the forward (grpo_kernels/chunked/loss_grad.py) against a float64 truth and
against the four-pass launchers (forward, then a backward that recomputes the logits).

The loss is L = Σ_n f_n(logp_n) + Σ_n g_H,n·H_n over the listed rows, with a non-linear f_n
(a·logp + q·logp²), so the launcher's callback must see each chunk's log-probs before their
gradient is formed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import leaf, make_head, scaled_err

from benchmarks.measure import LiveStorageTracker
from grpo_kernels import chunked
from grpo_kernels.chunked import loss_grad
from grpo_kernels.chunked.loss_grad import chunk_rows, linear_loss_grad

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


def test_chunk_rows_from_the_byte_budget():
    """As many whole rows as the budget holds (two [rows, V] buffers of the compute dtype: 8·V
    bytes a row in float32, 16·V in float64), at most n, at least 1; the default budget gives
    ~200+ rows at the real vocabularies."""
    f32, f64, row = torch.float32, torch.float64, 8 * 4096
    assert chunk_rows(4096, 4096, 64, f32, 400 * row)[0] == 400
    assert chunk_rows(4096, 4096, 64, f32, 401 * row - 1)[0] == 400
    assert chunk_rows(4096, 4096, 64, f64, 400 * row)[0] == 200
    # float64 logits of a float32 weight: its float64 copy and d W take 32 rows each
    assert chunk_rows(4096, 4096, 64, f32, 400 * row, dtype=f64)[0] == 200 - 2 * 32
    assert chunk_rows(30, 4096, 64, f32, 400 * row)[0] == 30
    assert chunk_rows(0, 4096, 64, f32, 400 * row)[0] == 1
    for V, D in ((151936, 896), (128256, 2048)):
        rows, reason = chunk_rows(4096, V, D, f32, loss_grad.CPU_BUDGET_BYTES)
        assert rows == loss_grad.CPU_BUDGET_BYTES // (8 * V) >= 200
        assert f"{rows} whole rows of V = {V:,}" in reason
    with pytest.raises(ValueError, match="budget_bytes"):
        chunk_rows(10, 97, 8, f32, -1)


def test_chunk_rows_declines_where_three_passes_do_not_pay():
    """Fewer than MIN_ROWS rows per chunk while the tokens need more chunks: None and a reason
    (the four-pass route is faster); one chunk of all the tokens is always taken."""
    V, least = 1_000_000, loss_grad.MIN_ROWS
    budget = (least - 1) * 8 * V
    rows, reason = chunk_rows(4 * least, V, 64, torch.float32, budget)
    assert rows is None
    assert reason == (f"the {budget:,}-byte chunk budget holds {least - 1} whole rows of "
                      f"V = 1,000,000, fewer than {least}")
    assert chunk_rows(least - 1, V, 64, torch.float32, budget)[0] == least - 1
    assert chunk_rows(4 * least, V, 64, torch.float32, least * 8 * V)[0] == least
    assert chunk_rows(1, V, 64, torch.float32, 8 * V - 1) == (
        None, f"the {8 * V - 1:,}-byte chunk budget holds 0 whole rows of V = 1,000,000, "
              "fewer than 1")
    hidden, weight, b, ids, a, q, _ = _problem(seed=6)
    with pytest.raises(ValueError, match="budget_bytes: the 7,760-byte chunk budget holds 10"):
        linear_loss_grad(hidden, weight, b, ids, 1.0, _callback(a, q, None, []),
                         budget_bytes=8 * 97 * 10)


def test_chunk_rows_of_a_16_bit_head(monkeypatch):
    """A bfloat16 head: its float32 d W [V, D] is in the budget (without room for it: None);
    one float32 copy of the weight when the budget holds it beside the rows it would hold
    without it, else a slice buffer of SLICE_BYTES."""
    V, D, bf16 = 1000, 64, torch.bfloat16
    whole, row, slice_bytes = V * D * 4, 8 * V, 100 * D * 4
    monkeypatch.setattr(loss_grad, "SLICE_BYTES", slice_bytes)
    rows, reason = chunk_rows(500, V, D, bf16, whole - 1)
    assert rows is None and reason == (
        f"the {whole - 1:,}-byte chunk budget does not hold the float32 d weight of a "
        f"bfloat16 head [1,000, 64] ({whole / 2**20:.1f} MiB)")
    assert chunk_rows(20, V, D, bf16, whole - 1, want_dw=False)[0] == 20  # no d W
    for budget, want in ((2 * whole + 500 * row, (500, V)),  # the copy and every row
                         (2 * whole + 499 * row, (500, 100)),  # the copy would cost a row
                         (whole + slice_bytes + 100 * row, (100, 100))):
        plan = loss_grad._plan(500, V, D, bf16, budget, None, True)
        assert (plan.rows, plan.cols) == want
        assert ("slices of 100 rows" in plan.reason) == (want[1] < V)
    too_few = whole + slice_bytes + (loss_grad.MIN_ROWS - 1) * row
    assert chunk_rows(500, V, D, bf16, too_few)[0] is None


def _truth_and_four_pass(hidden, weight, b, ids, temperature, a, gh):
    """float64 truth of Σ a·logp + Σ gh·H, and the four-pass launchers' gradients of it."""
    truth = _truth(hidden, weight, b, ids, temperature, a, torch.zeros_like(a), gh, None)
    logp, ent, lse = chunked.linear_logprob_forward(hidden, weight, b, ids, temperature)
    four = chunked.linear_logprob_backward(hidden, weight, b, ids, lse, ent, a, gh, temperature)
    return truth, (logp, ent, *four)


@pytest.mark.parametrize("copy", [True, False], ids=["float32 copy", "slices"])
@pytest.mark.parametrize("entropy", [False, True])
def test_16_bit_head_with_and_without_room_for_a_float32_copy(copy, entropy, monkeypatch):
    """bfloat16 hidden, weight and bias, in chunks of 8 rows: with one float32 copy of the
    weight, or converted in slices of 7 vocabulary rows inside each chunk's GEMMs. Against
    float64 on the same bfloat16 values and against the four-pass launchers (the same float32
    arithmetic)."""
    N, D, V = 50, 24, 97
    monkeypatch.setattr(loss_grad, "SLICE_BYTES", 7 * D * 4)
    monkeypatch.setattr(loss_grad, "MIN_ROWS", 1)
    hidden, weight, b, ids, a, _, gh = _problem(N=N, D=D, V=V, bias=True, seed=8,
                                                dtype=torch.bfloat16)
    gh = gh if entropy else None
    # d W, then the copy and every row (chunks of 8 given), or a slice and 8 rows
    budget = V * D * 4 + (V * D * 4 + N * 8 * V if copy else 7 * D * 4 + 8 * 8 * V)
    plan = loss_grad._plan(N, V, D, weight.dtype, budget, None, True)
    assert (plan.rows, plan.cols) == ((N, V) if copy else (8, 7))
    seen = []
    out = linear_loss_grad(hidden, weight, b, ids, 0.7, _callback(a, 0 * a, None, seen), gh,
                           budget_bytes=budget, chunk_rows=8)
    assert len(seen) == 7
    truth, four = _truth_and_four_pass(hidden, weight, b, ids, 0.7, a, gh)
    ours = (out.logp, out.entropy, out.d_hidden, out.d_weight, out.d_bias)
    for name, o, t, f, x in zip(["logp", "entropy", "d hidden", "d weight", "d bias"], ours,
                                (truth[0], truth[1], *truth[2:]), (four[0], four[1], *four[2:]),
                                (None, None, hidden, weight, b)):
        if x is None:
            assert scaled_err(o, t) < 2e-5 and scaled_err(o, f) < 1e-6, name
        else:
            assert o.dtype == x.dtype, name
            assert scaled_err(o, t) <= torch.finfo(x.dtype).eps + 2e-5, name
            assert scaled_err(o, f) <= torch.finfo(x.dtype).eps, name


@pytest.mark.parametrize("copy", [True, False], ids=["float32 copy", "slices"])
def test_no_float32_copy_of_a_16_bit_head_without_room(copy, monkeypatch):
    """A frozen bfloat16 head (no d W): its live storage holds a [V, D] float32 copy only when
    the budget does."""
    N, D, V = 16, 64, 4000
    monkeypatch.setattr(loss_grad, "SLICE_BYTES", 100 * D * 4)
    hidden, weight, _, ids, a, q, _ = _problem(N=N, D=D, V=V, seed=10, dtype=torch.bfloat16)
    budget = (V * D * 4 if copy else 100 * D * 4) + N * 8 * V
    with LiveStorageTracker() as tracker:
        out = linear_loss_grad(hidden, weight, None, ids, 1.0, _callback(a, q, None, []),
                               needs=(True, False, False), budget_bytes=budget)
    assert (tracker.peak > V * D * 4) == copy
    assert out.d_weight is None and out.d_hidden.dtype == torch.bfloat16


def test_many_chunks_accumulate_d_weight(monkeypatch):
    """A budget of 3 rows: 20 chunks, the first writes d W and d b, the others add to them."""
    monkeypatch.setattr(loss_grad, "MIN_ROWS", 1)
    hidden, weight, b, ids, a, q, gh = _problem(bias=True, seed=9)
    seen = []
    out = linear_loss_grad(hidden, weight, b, ids, 0.9, _callback(a, q, None, seen), gh,
                           budget_bytes=3 * 8 * 97 + 7)
    assert seen == [(r0, 3) for r0 in range(0, 60, 3)]
    truth = _truth(hidden, weight, b, ids, 0.9, a, q, gh, None)
    for o, t in zip((out.logp, out.entropy, out.d_hidden, out.d_weight, out.d_bias), truth):
        assert scaled_err(o, t) < 2e-6


_REAL_VOCABULARY = """
import json, logging, os, torch
import grpo_kernels as gk
from grpo_kernels.ops import route
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("grpo_kernels").addHandler(handler)
logging.getLogger("grpo_kernels").setLevel(logging.INFO)
g = torch.Generator().manual_seed(0)
B, T, D, V = 4, int(os.environ["T"]), 16, 151936
hidden = torch.randn(B, T, D, generator=g)
weight = torch.nn.Parameter(torch.randn(V, D, generator=g) * 0.5)
ids = torch.randint(0, V, (B, T), generator=g)
mask = torch.ones(B, T)
mask[:, -3:] = 0.0
adv, old = torch.randn(B, generator=g), -torch.rand(B, T, generator=g) * 12 - 3
out = []
for three in ("1", "0"):
    os.environ[route.ENV] = three
    h = hidden.clone().requires_grad_()
    weight.grad = None
    with gk.force_backend("chunked"):
        loss, _ = gk.fused_linear_grpo_loss(h, weight, ids, adv, mask, old, old, beta=0.04)
    loss.backward()
    out.append((loss.detach(), h.grad, weight.grad))
err = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*out)]
print(json.dumps(dict(lines=lines, err=err, rows=int(mask.sum()))))
"""


def test_real_vocabulary_takes_the_three_pass_route():
    """V = 151,936 (Qwen2.5) with an nn.Parameter weight, as a model's lm_head is: the public
    loss on the chunked backend takes the three-pass route (the logger says so, in a fresh
    process: the route is logged once per process) in two chunks of the default budget, and
    matches the four-pass route."""
    root = Path(__file__).resolve().parents[2]
    rows = chunk_rows(10**6, 151936, 16, torch.float32, loss_grad.CPU_BUDGET_BYTES)[0]
    T = rows // 4 + 10  # 4·(T - 3) > rows tokens to compute: two chunks
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", T=str(T))
    proc = subprocess.run([sys.executable, "-c", _REAL_VOCABULARY], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rows < got["rows"] <= 2 * rows
    assert [line.split(": ")[1] for line in got["lines"]] == [
        "linear-head loss on the three-pass route", "linear-head loss on the four-pass route"]
    assert max(got["err"]) < 1e-5


def test_memory_is_two_chunks_not_the_logits():
    """Live storage stays near two [rows, V] chunks plus the gradients: far below [N, V]."""
    N, D, V = 8192, 16, 2048
    hidden, weight, _, ids = make_head(1, N, D, V, torch.float32, "cpu", seed=7)
    a = torch.randn(N)
    assert chunk_rows(N, V, D, torch.float32, 2**22)[0] == 256
    with LiveStorageTracker() as tracker:
        linear_loss_grad(hidden[0], weight, None, ids[0], 1.0, lambda r0, r, lp: a[r0:r0 + r],
                         budget_bytes=2**22)
    assert tracker.peak < N * V * 4 / 8
