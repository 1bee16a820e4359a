"""The default linear-head backward (d logits per chunk + GEMMs, `linear_backward_gemm.py`) and
its float32 accumulation (`accumulate_mm.py`): against a float64 truth, in both chunk
orientations over several chunks, for every `needs` combination; bitwise deterministic; no
atomics; and the dispatch under torch.use_deterministic_algorithms."""

import contextlib
import warnings

import pytest
import torch
from helpers import leaf, make_head, max_err

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels import linear_backward_gemm as gemm
from grpo_kernels.kernels import linear_logprobs
from grpo_kernels.kernels.accumulate_mm import accumulate_mm
from grpo_kernels.ops.backends import BACKWARD_ENV, linear_backward_mode

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# N = 75 tokens (5 blocks of the interpreter's BLOCK_N=16, the last one partial), D = 24,
# V = 150 (5 vocabulary tiles of 32, the last partial)
N, D, V = 75, 24, 150
# one tile row of 16-bit d logits: tokens -> 16-row chunks, vocab -> 32-column chunks (5 each)
TINY = 16 * 32 * 2


def _problem(dtype, bias=True, gent=True, seed=0, temperature=0.8):
    hidden, weight, b, ids = make_head(1, N, D, V, torch.float32, "cpu", seed=seed, bias=bias,
                                       scale=3.0)
    gen = torch.Generator().manual_seed(seed + 1)
    g = torch.randn(N, generator=gen)
    gh = torch.randn(N, generator=gen) if gent else None
    g[16:32] = 0.0  # one fully masked token block: no recompute, zero d hidden rows
    if gh is not None:
        gh[16:32] = 0.0
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(hidden.reshape(N, D)), cast(weight), cast(b), ids.reshape(N), g, gh, temperature


def _autograd_grads(h, w, b, ids, g, gh, temperature, needs):
    """Gradients of Σ g·logp + Σ gh·H by autograd through the reference (any dtype)."""
    h, w, b = (leaf(x).requires_grad_(need) if x is not None else None
               for x, need in zip((h, w, b), needs))
    logp, ent = reference.selective_logprobs(h, w, ids, b, temperature=temperature,
                                             return_entropy=True)
    loss = (g.to(logp.dtype) * logp).sum()
    if gh is not None:
        loss = loss + (gh.to(ent.dtype) * ent).sum()
    loss.backward()
    return [None if x is None or not x.requires_grad else x.grad for x in (h, w, b)]


def _ours(h, w, b, ids, g, gh, temperature, needs=(True, True, True), **kw):
    _, ent, lse = linear_logprobs.linear_logprob_forward(h, w, b, ids, temperature)
    return gemm.linear_logprob_backward_gemm(h, w, b, ids, lse, ent, g, gh, temperature,
                                             needs=needs, **kw)


def _check_against_truth(problem, ours, needs):
    h, w, b, ids, g, gh, temperature = problem
    wide = lambda x: None if x is None else x.double()  # noqa: E731
    truth = _autograd_grads(wide(h), wide(w), wide(b), ids, g.double(),
                            wide(gh), temperature, needs)
    same = _autograd_grads(h, w, b, ids, g, gh, temperature, needs)
    for name, o, s, t in zip(("d hidden", "d weight", "d bias"), ours, same, truth):
        if t is None:
            assert o is None, name
            continue
        assert o.dtype == h.dtype and o.shape == t.shape, name
        scale = max(1e-3, t.abs().max().item())
        assert max_err(o, t) <= 2 * max_err(s, t) + TOL[h.dtype] * scale, (
            f"{name}: ours {max_err(o, t):.3g} vs torch {max_err(s, t):.3g}")


@pytest.mark.parametrize("orientation", ["tokens", "vocab"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunks_in_both_orientations_match_float64_truth(dtype, orientation):
    """Five chunks (tiny buffer) summed in float32, bias and entropy gradient, a masked block."""
    problem = _problem(dtype, seed=1)
    ours = _ours(*problem, buffer_bytes=TINY, orientation=orientation)
    _check_against_truth(problem, ours, (True, True, True))
    assert torch.all(ours[0][16:32] == 0)  # the masked token block


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True),
                                   (False, False, True), (True, False, True)])
@pytest.mark.parametrize("orientation", ["tokens", "vocab"])
def test_needs_skip_gradients_and_keep_the_others(needs, orientation):
    """Only the gradients asked for come back, each equal to the full computation's."""
    problem = _problem(torch.float16, seed=2)
    full = _ours(*problem, buffer_bytes=TINY, orientation=orientation)
    part = _ours(*problem, needs=needs, buffer_bytes=TINY, orientation=orientation)
    for need, f, p in zip(needs, full, part):
        if not need:
            assert p is None
        else:
            assert max_err(p, f) <= 1e-3 * f.abs().max().item()
    _check_against_truth(problem, part, needs)


@pytest.mark.parametrize("bias,gent", [(False, False), (False, True), (True, False)])
def test_without_bias_or_entropy_gradient_fp32(bias, gent):
    problem = _problem(torch.float32, bias=bias, gent=gent, seed=3, temperature=1.0)
    for orientation in ("tokens", "vocab"):
        ours = _ours(*problem, buffer_bytes=2 * TINY, orientation=orientation)
        assert (ours[2] is None) == (not bias)
        _check_against_truth(problem, ours, (True, True, True))


def test_default_plan_single_chunk_and_fully_masked_input():
    """The default budget (here several chunks), one chunk (no accumulator), and all tokens
    masked (every gradient exactly zero)."""
    problem = _problem(torch.float32, seed=4)
    _check_against_truth(problem, _ours(*problem), (True, True, True))
    _check_against_truth(problem, _ours(*problem, buffer_bytes=2**30), (True, True, True))
    h, w, b, ids, g, gh, temperature = problem
    zero = _ours(h, w, b, ids, g * 0, gh * 0, temperature, buffer_bytes=TINY)
    assert all(torch.count_nonzero(x) == 0 for x in zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bitwise_deterministic(dtype):
    problem = _problem(dtype, seed=5)
    for orientation in ("tokens", "vocab"):
        first = _ours(*problem, buffer_bytes=TINY, orientation=orientation)
        second = _ours(*problem, buffer_bytes=TINY, orientation=orientation)
        for a, b in zip(first, second):
            assert torch.equal(a, b)


@contextlib.contextmanager
def _count_atomics():
    """Counts the atomic operations the interpreter executes (every tl.atomic_* goes through
    one of these builder methods)."""
    from triton.runtime import interpreter

    calls = []
    builder = interpreter.InterpreterBuilder
    names = [n for n in dir(builder) if n.startswith("create_atomic")]
    saved = {n: getattr(builder, n) for n in names}

    def counting(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return saved[name](self, *args, **kwargs)
        return method

    for n in names:
        setattr(builder, n, counting(n))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(builder, n, fn)


def _backward_through_api(grad_filter=None):
    hidden, weight, b, ids = make_head(2, 19, 16, 70, torch.float32, "cpu", seed=6, bias=True,
                                       scale=3.0)
    b[32:] -= 9.0  # vocabulary tiles 1 and 2 hold little probability: filtering drops them
    ids = ids % 32  # targets in tile 0
    h, w, bb = leaf(hidden), leaf(weight), leaf(b)
    with gk.force_backend("triton"):
        logp, ent = gk.selective_logprobs(h, w, ids, bb, return_entropy=True,
                                          grad_filter=grad_filter)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return h.grad, w.grad, bb.grad


def test_default_backward_issues_no_atomics(monkeypatch):
    monkeypatch.delenv(BACKWARD_ENV, raising=False)
    with _count_atomics() as calls:
        default = _backward_through_api()
    assert calls == []
    monkeypatch.setenv(BACKWARD_ENV, "atomic")  # positive control: the counter sees atomics
    with _count_atomics() as calls:
        atomic = _backward_through_api()
    assert len(calls) > 0
    for x, y in zip(default, atomic):
        assert max_err(x, y) <= 1e-5 * y.abs().max().item()


def test_backward_mode_dispatch_and_deterministic_mode(monkeypatch):
    monkeypatch.delenv(BACKWARD_ENV, raising=False)
    assert linear_backward_mode(None) == "gemm"
    assert linear_backward_mode(1e-4) == "atomic"  # filtering saves work only there
    assert linear_backward_mode(0.0) == "gemm"  # eps = 0 is exact
    monkeypatch.setenv(BACKWARD_ENV, "gemm")
    assert linear_backward_mode(1e-4) == "gemm"
    monkeypatch.setenv(BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match=BACKWARD_ENV):
        linear_backward_mode(None)
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        monkeypatch.delenv(BACKWARD_ENV)
        assert linear_backward_mode(1e-4) == "gemm"
        monkeypatch.setenv(BACKWARD_ENV, "atomic")
        with pytest.raises(RuntimeError, match="deterministic"):
            _backward_through_api()
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="deterministic"):
            assert linear_backward_mode(None) == "atomic"
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def test_deterministic_mode_filters_like_the_atomic_backward(monkeypatch):
    """grad_filter under deterministic mode runs the GEMM backward with the same tile rule:
    the same gradients as the atomic backward's filtering, and no atomics."""
    monkeypatch.delenv(BACKWARD_ENV, raising=False)
    filtered_atomic = _backward_through_api(grad_filter=0.05)
    exact = _backward_through_api()
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with _count_atomics() as calls, warnings.catch_warnings():
            warnings.simplefilter("error")
            filtered = _backward_through_api(grad_filter=0.05)
    finally:
        torch.use_deterministic_algorithms(was)
    assert calls == []
    for f, a, e in zip(filtered, filtered_atomic, exact):
        assert max_err(f, a) <= 1e-5 * a.abs().max().item()
        assert max_err(f, e) > 0.0  # the filter changed something
    # whole dropped vocabulary tiles get exactly zero d bias where the exact one is not
    assert int((filtered[2] == 0).sum()) > int((exact[2] == 0).sum())


def test_chunk_plan_bounds_memory_and_picks_the_smaller_accumulator():
    mib = 2**20
    # 5% of eager float32 logits, capped at 256 MiB
    assert gemm.dz_budget_bytes(4096, 32768) == int(0.05 * 4 * 4096 * 32768)
    assert gemm.dz_budget_bytes(16384, 151936) == 256 * mib
    for n, v in ((16384, 151936), (4096, 32768), (100, 50), (1, 151936)):
        budget = gemm.dz_budget_bytes(n, v)
        rows, cols = gemm.chunk_sizes(n, v, 128, 128, 2 + 4 / 128, budget)
        assert rows % 128 == 0 and cols % 128 == 0
        # within budget, or a single tile row when the budget is smaller than that
        assert min(rows, n) * v * 2 <= max(budget, 128 * v * 2)
        assert n * min(cols, v) * 2 <= max(budget, 128 * n * 2)
    # a Qwen2.5-0.5B head at N = 16384: V > N, summing d hidden [N, D] moves less than d weight
    rows, cols = gemm.chunk_sizes(16384, 151936, 128, 128, 2, gemm.dz_budget_bytes(16384, 151936))
    assert gemm.pick_orientation(16384, 151936, 896, rows, cols, True, True) == "vocab"
    assert gemm.pick_orientation(16384, 151936, 896, rows, cols, True, False) == "tokens"
    assert gemm.pick_orientation(16384, 151936, 896, rows, cols, False, True) == "vocab"
    rows, cols = gemm.chunk_sizes(65536, 1000, 128, 128, 2, gemm.dz_budget_bytes(65536, 1000))
    assert gemm.pick_orientation(65536, 1000, 64, rows, cols, True, True) == "tokens"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_accumulate_mm_sums_in_float32(dtype):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(37, 45, generator=g).to(dtype)
    b = torch.randn(45, 29, generator=g).to(dtype)
    acc0 = torch.randn(37, 29, generator=g)
    truth = acc0.double() + a.double() @ b.double()  # the products of 16-bit values are exact
    for lhs in (a, a.T.contiguous().T):  # row-major, and the transpose of a row-major array
        acc = acc0.clone()
        accumulate_mm(acc, lhs, b)
        assert max_err(acc, truth) <= 1e-5 * truth.abs().max().item()
        again = acc0.clone()
        accumulate_mm(again, lhs, b)
        assert torch.equal(acc, again)
    with pytest.raises(ValueError, match="float32"):
        accumulate_mm(acc0.half(), a, b)
    with pytest.raises(TypeError, match="share a dtype"):
        accumulate_mm(acc0, a, b.float())


# ---- forward: full tiles without the vocabulary mask, the target logit as one dot per token


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("V_", [128, 150])  # 4 full tiles of 32; 4 full + a partial one
def test_forward_tiles_and_splits_match_float64_truth(dtype, V_):
    """Every split count puts the partial tile (if any) in the last split only; targets include
    the first and the last vocabulary row, and a token whose target dominates (logp near 0)."""
    hidden, weight, b, ids = make_head(1, 37, 40, V_, torch.float32, "cpu", seed=8, bias=True,
                                       scale=4.0)
    h2, ids2 = hidden.reshape(37, 40), ids.reshape(37).clone()
    ids2[0], ids2[1], ids2[2] = 0, V_ - 1, 5
    b[5] += 30.0  # token 2's target (and every token's argmax): p ≈ 1 there
    truth = reference.selective_logprobs(h2.double(), weight.double(), ids2, b.double(),
                                         temperature=0.7, return_entropy=True)
    same = reference.selective_logprobs(h2.to(dtype), weight.to(dtype), ids2, b.to(dtype),
                                        temperature=0.7, return_entropy=True)
    lse_truth = torch.logsumexp((h2.double() @ weight.double().T + b.double()) / 0.7, dim=-1)
    for splits in (1, 2, 3, 5):
        logp, ent, lse = linear_logprobs.linear_logprob_forward(
            h2.to(dtype), weight.to(dtype), b.to(dtype), ids2, 0.7, splits=splits)
        for name, o, s, t in (("logp", logp, same[0], truth[0]),
                              ("entropy", ent, same[1], truth[1])):
            assert max_err(o, t) <= 2 * max_err(s, t) + TOL[dtype] * max(1.0, t.abs().max()), (
                name, splits)
        assert max_err(lse, lse_truth) <= 2 * max_err(same[0], truth[0]) + TOL[dtype] * (
            lse_truth.abs().max().item())
        assert abs(logp[2].item()) < 1e-5  # the dominant target: logp = z_t - lse ≈ 0


def test_split_forward_with_the_fused_epilogue(monkeypatch):
    """Vocabulary splits (as on a GPU) with the GRPO epilogue in the combine kernel: the loss
    and gradients match the unsplit run."""
    from helpers import hyper, make_grpo_batch

    from grpo_kernels.kernels import tile_configs

    hidden, weight, b, ids = make_head(2, 21, 24, 150, torch.float32, "cpu", seed=9, bias=True,
                                       scale=3.0)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, b, ids)
    kw = hyper("dapo", "token", 0.04, 0.8, None)
    runs = []
    for splits in (1, 3):
        monkeypatch.setattr(tile_configs, "num_splits", lambda *a, s=splits, **k: s)
        h, w = leaf(hidden), leaf(weight)
        with gk.force_backend("triton"):
            loss, metrics = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, b, **kw)
        loss.backward()
        runs.append((loss.detach(), h.grad, w.grad))
    for x, y in zip(*runs):
        assert max_err(x, y) <= 1e-5 * max(1.0, y.abs().max().item())
