"""selective_logprobs: Triton (interpreter on CPU) and chunked paths against a float64 truth.

Error bound in the CCE style: our error against float64 must not exceed PyTorch's own error in the
same dtype (the reference evaluated in that dtype) by more than a small tolerance."""

import pytest
import torch
from helpers import leaf, make_head, max_err, on_device

import grpo_kernels as gk
from grpo_kernels import chunked, reference
from grpo_kernels.chunked import blocks
from grpo_kernels.kernels import linear_logprobs
from grpo_kernels.kernels.linear_backward_atomic import linear_logprob_backward_atomic

BACKENDS = ["triton", "chunked"]
# (B, T, D, V): an odd shape, and one spanning 10 vocabulary tiles (BLOCK_V=32) and 2 D tiles
SHAPES = [(3, 47, 31, 123), (2, 9, 40, 300)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# bfloat16 (the dtype users train in) at one temperature: a representative subset, not the
# full cross product, to keep CI time down
DTYPE_TEMPERATURES = [(torch.float32, 1.0), (torch.float32, 0.7), (torch.float16, 1.0),
                      (torch.float16, 0.7), (torch.bfloat16, 0.7)]


def _run(fn, hidden, weight, bias, ids, temperature, coef):
    """logp, entropy and the gradients of Σ c0·logp + Σ c1·H."""
    h, w, b = leaf(hidden), leaf(weight), leaf(bias)
    logp, ent = fn(h, w, ids, b, temperature=temperature, return_entropy=True)
    ((coef[0] * logp).sum() + (coef[1] * ent).sum()).backward()
    grads = [h.grad, w.grad] + ([] if b is None else [b.grad])
    return [logp.detach(), ent.detach()] + grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,temperature", DTYPE_TEMPERATURES,
                         ids=[f"{str(d)[6:]}-t{t}" for d, t in DTYPE_TEMPERATURES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64_truth(backend, dtype, shape, bias, temperature):
    B, T, D, V = shape
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=7, bias=bias,
                                       scale=4.0)
    coef = torch.randn(2, B, T, generator=torch.Generator().manual_seed(3))
    cast = lambda x, dt: None if x is None else x.to(dt)  # noqa: E731
    truth = _run(reference.selective_logprobs, hidden.double(), weight.double(),
                 cast(b, torch.float64), ids, temperature, coef.double())
    same = _run(reference.selective_logprobs, hidden.to(dtype), weight.to(dtype), cast(b, dtype),
                ids, temperature, coef)
    with gk.force_backend(backend):
        ours = _run(on_device(gk.selective_logprobs, backend), hidden.to(dtype),
                    weight.to(dtype), cast(b, dtype), ids, temperature, coef)
    names = ["logp", "entropy", "d hidden", "d weight", "d bias"]
    for name, o, s, t in zip(names, ours, same, truth):
        assert o.dtype == (torch.float32 if name in ("logp", "entropy") else dtype), name
        scale = max(1.0, t.abs().max().item())
        assert max_err(o, t) <= 2 * max_err(s, t) + TOL[dtype] * scale, (
            f"{name}: ours {max_err(o, t):.3g} vs torch {max_err(s, t):.3g}")


def test_vocabulary_splits_match_single_pass():
    """The split-vocabulary forward (the grouped order on a GPU) combines partials exactly;
    N=75 gives 5 token blocks, a group of GROUP_N=2 with a remainder."""
    hidden, weight, b, ids = make_head(1, 75, 24, 250, torch.float32, "cpu", seed=1, bias=True)
    h2, ids2 = hidden.reshape(-1, 24), ids.reshape(-1)
    one = linear_logprobs.linear_logprob_forward(h2, weight, b, ids2, 0.8, splits=1)
    for splits in (2, 3, 8):
        many = linear_logprobs.linear_logprob_forward(h2, weight, b, ids2, 0.8, splits=splits)
        for x, y in zip(one, many):
            assert max_err(x, y) < 1e-5


def test_backward_vocab_chunks_match_single_chunk():
    """16-bit weights accumulate d weight in float32 scratch chunks of the vocabulary."""
    hidden, weight, b, ids = make_head(2, 13, 20, 200, torch.float16, "cpu", seed=2, bias=True)
    h2, ids2 = hidden.reshape(-1, 20), ids.reshape(-1)
    logp, ent, lse = linear_logprobs.linear_logprob_forward(h2, weight, b, ids2, 1.0)
    g = torch.randn(26)
    gh = torch.randn(26)
    whole = linear_logprob_backward_atomic(h2, weight, b, ids2, lse, ent, g, gh, 1.0)
    bytes_for_two_tiles = 2 * 32 * 20 * 4
    parts = linear_logprob_backward_atomic(h2, weight, b, ids2, lse, ent, g, gh, 1.0,
                                                    scratch_bytes=bytes_for_two_tiles)
    for x, y in zip(whole, parts):
        assert max_err(x, y) < 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_gradient_tokens_do_no_work_and_give_zero(backend):
    hidden, weight, _, ids = make_head(2, 5, 8, 40, torch.float32, "cpu")
    h, w = leaf(hidden), leaf(weight)
    with gk.force_backend(backend):
        logp = on_device(gk.selective_logprobs, backend)(h, w, ids)
    (logp * 0).sum().backward()
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_empty_input(backend):
    hidden, weight, _, ids = make_head(2, 3, 8, 17, torch.float32, "cpu")
    logprobs = on_device(gk.selective_logprobs, backend)
    with gk.force_backend(backend):
        out = logprobs(hidden.reshape(2, 3, 1, 8), weight, ids.reshape(2, 3, 1))
        assert out.shape == (2, 3, 1)
        h0 = leaf(hidden[:0])
        empty = logprobs(h0, weight, ids[:0])
        empty.sum().backward()
    assert empty.shape == (0, 3) and h0.grad.shape == (0, 3, 8)
    ref = reference.selective_logprobs(hidden, weight, ids)
    assert max_err(out.reshape(2, 3), ref) < 1e-5


def test_chunked_path_bounds_its_temporaries():
    """Chunk rows are chosen from the element budget, so [chunk, V] never grows with N."""
    assert blocks.block_rows(151936, 2**24) == 110
    hidden, weight, _, ids = make_head(4, 50, 8, 64, torch.float32, "cpu")
    h2, ids2 = hidden.reshape(-1, 8), ids.reshape(-1)
    small = chunked.linear_logprob_forward(h2, weight, None, ids2, 1.0, chunk_elements=64 * 7)
    whole = chunked.linear_logprob_forward(h2, weight, None, ids2, 1.0)
    for x, y in zip(small, whole):
        assert max_err(x, y) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_on_gpu(bias):
    B, T, D, V = 4, 257, 896, 151936
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cuda", seed=5, bias=bias,
                                       scale=4.0)
    coef = torch.randn(2, B, T, device="cuda")
    cast = lambda x, dt: None if x is None else x.to(dt)  # noqa: E731
    truth = _run(reference.selective_logprobs, hidden.double(), weight.double(),
                 cast(b, torch.float64), ids, 1.0, coef.double())
    same = _run(reference.selective_logprobs, hidden.bfloat16(), weight.bfloat16(),
                cast(b, torch.bfloat16), ids, 1.0, coef)
    ours = _run(gk.selective_logprobs, hidden.bfloat16(), weight.bfloat16(),
                cast(b, torch.bfloat16), ids, 1.0, coef)
    for o, s, t in zip(ours, same, truth):
        scale = max(1.0, t.abs().max().item())
        assert max_err(o, t) <= 2 * max_err(s, t) + 1e-2 * scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_or_hidden_skip_their_gradient(backend):
    """A frozen lm_head (or hidden) gets no gradient and the other one is unchanged."""
    hidden, weight, b, ids = make_head(2, 9, 12, 70, torch.float32, "cpu", seed=11, bias=True)
    coef = torch.randn(2, 9)
    full = _run(reference.selective_logprobs, hidden, weight, b, ids, 0.9, (coef, coef))
    # bounded as elsewhere: by PyTorch's own float32 error against float64 (a fixed 1e-5 was
    # within float32 rounding of the threads' summation order)
    truth = _run(reference.selective_logprobs, hidden.double(), weight.double(), b.double(), ids,
                 0.9, (coef.double(), coef.double()))
    for frozen in ("weight", "hidden"):
        h = hidden.clone().requires_grad_(frozen != "hidden")
        w = weight.clone().requires_grad_(frozen != "weight")
        with gk.force_backend(backend):
            logp = on_device(gk.selective_logprobs, backend)(h, w, ids, b, temperature=0.9,
                                                             return_entropy=True)
        (coef * logp[0] + coef * logp[1]).sum().backward()
        live, dead = (h, w) if frozen == "weight" else (w, h)
        assert dead.grad is None
        k = 2 if frozen == "weight" else 3
        scale = max(1.0, truth[k].abs().max().item())
        assert max_err(live.grad, truth[k]) <= 2 * max_err(full[k], truth[k]) + 1e-6 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gemm_backward_matches_atomic_backward(dtype):
    """GRPO_KERNELS_LINEAR_BACKWARD=gemm (d logits per token chunk + GEMMs) gives the atomic
    kernel's gradients, over several chunks, with bias, entropy gradient and masked tokens."""
    from grpo_kernels.kernels import linear_backward_gemm

    hidden, weight, b, ids = make_head(3, 31, 24, 150, dtype, "cpu", seed=12, bias=True)
    h2, ids2 = hidden.reshape(-1, 24), ids.reshape(-1)
    logp, ent, lse = linear_logprobs.linear_logprob_forward(h2, weight, b, ids2, 0.8)
    g, gh = torch.randn(93), torch.randn(93)
    g[20:52] = 0.0
    gh[20:52] = 0.0  # two all-masked token blocks of 16
    atomic = linear_logprob_backward_atomic(h2, weight, b, ids2, lse, ent, g, gh, 0.8)
    one_chunk_rows = 16 * 150 * h2.element_size()
    for buffer in (one_chunk_rows, 3 * one_chunk_rows, 2**30):
        gemm = linear_backward_gemm.linear_logprob_backward_gemm(
            h2, weight, b, ids2, lse, ent, g, gh, 0.8, buffer_bytes=buffer)
        for x, y in zip(gemm, atomic):
            assert x.dtype == y.dtype
            assert max_err(x, y) <= TOL[dtype] * max(1.0, y.abs().max().item())


def test_backward_mode_is_selected_by_environment(monkeypatch):
    hidden, weight, _, ids = make_head(2, 5, 8, 40, torch.float32, "cpu")
    grads = {}
    for mode in ("atomic", "gemm"):
        monkeypatch.setenv("GRPO_KERNELS_LINEAR_BACKWARD", mode)
        h = leaf(hidden)
        with gk.force_backend("triton"):
            gk.selective_logprobs(h, weight, ids).sum().backward()
        grads[mode] = h.grad
    assert max_err(grads["atomic"], grads["gemm"]) < 1e-5
    monkeypatch.setenv("GRPO_KERNELS_LINEAR_BACKWARD", "fast")
    with gk.force_backend("triton"), pytest.raises(ValueError, match="must be one of"):
        gk.selective_logprobs(leaf(hidden), weight, ids).sum().backward()


# Mixed head precision (a float32 lm_head with 16-bit hidden): the kernels split the weight into
# two pieces of the hidden's dot format (precision.split_dot). Measured here (interpreter, the
# SHAPES[0] head with bias, τ=0.7, errors against float64 on the same 16-bit hidden values):
# logp off by 3.0e-4 (bf16 hidden, bf16 hi+lo split) and 5.8e-6 (fp16 hidden, TF32 hi+lo split),
# against 5.1e-6 for an all-float32 PyTorch head and 0.11 / 0.013 for a head cast to 16 bits.
MIXED_TOL = {torch.bfloat16: 1e-4, torch.float16: 2e-5}


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_head_precision(backend, hidden_dtype):
    B, T, D, V = SHAPES[0]
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=7, bias=True,
                                       scale=4.0)
    hidden = hidden.to(hidden_dtype)
    coef = torch.randn(2, B, T, generator=torch.Generator().manual_seed(3))
    truth = _run(reference.selective_logprobs, hidden.double(), weight.double(), b.double(), ids,
                 0.7, coef.double())
    fp32_head = _run(reference.selective_logprobs, hidden.float(), weight, b, ids, 0.7, coef)
    head16 = _run(reference.selective_logprobs, hidden, weight.to(hidden_dtype),
                  b.to(hidden_dtype), ids, 0.7, coef)
    with gk.force_backend(backend):
        ours = _run(on_device(gk.selective_logprobs, backend), hidden, weight, b, ids, 0.7,
                    coef)
    names = ["logp", "entropy", "d hidden", "d weight", "d bias"]
    for name, o, s, h16, t in zip(names, ours, fp32_head, head16, truth):
        # each gradient in its input's dtype: d hidden 16-bit, d weight and d bias float32
        assert o.dtype == (hidden_dtype if name == "d hidden" else torch.float32), name
        scale = max(1.0, t.abs().max().item())
        bound = 2 * max_err(s.to(o.dtype), t) + MIXED_TOL[hidden_dtype] * scale
        assert max_err(o, t) <= bound, f"{name}: ours {max_err(o, t):.3g} vs {bound:.3g}"
        if name != "d hidden":  # far better than casting the head to 16 bits
            assert max_err(o, t) < 0.1 * max_err(h16, t), name
