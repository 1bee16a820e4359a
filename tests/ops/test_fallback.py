"""The safety net (grpo_kernels/ops/fallback.py): a Triton kernel that fails to compile or launch is
replaced by the chunked PyTorch path with one warning naming the cause; GRPO_KERNELS_STRICT=1 and
force_backend("triton") raise instead; errors that are not compile/launch failures (bad input, a
bug in our code, the interpreter's report of a kernel bug, a poisoned CUDA context) propagate.

Failures are forced in the interpreter by replacing a kernel object with one whose launch raises
Triton's own compile errors, as `kernel[grid](...)` does on a GPU when the build fails."""

import os
import warnings

import pytest
import torch
import triton
from helpers import leaf, make_grpo_batch, make_head
from triton.compiler.errors import CompilationError
from triton.runtime.errors import InterpreterError, OutOfResources

import grpo_kernels as gk
from grpo_kernels.kernels import (
    linear_backward_atomic,
    linear_backward_gemm,
    linear_logprobs,
    logits_logprobs,
)
from grpo_kernels.ops import fallback

pytestmark = pytest.mark.usefixtures("one_thread")
KW = dict(beta=0.04, loss_type="dapo", epsilon_high=0.28, entropy_coef=0.01)


class FailingKernel:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` raises `error`."""

    def __init__(self, error):
        self.error, self.launches = error, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            raise self.error
        return launch


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.delenv(fallback.STRICT_ENV, raising=False)
    fallback.reset()
    yield
    fallback.reset()


def compile_error():
    return CompilationError(None, None, "unsupported layout conversion (forced by the test)")


def batch(seed=0, B=2, T=5, D=8, V=37):
    hidden, weight, bias, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=seed, bias=True,
                                          scale=2.0)
    return (hidden, weight, bias, ids), make_grpo_batch(hidden, weight, bias, ids, seed=seed)


def linear_loss(head, grpo, **kw):
    hidden, weight, bias, ids = head
    mask, adv, old, ref = grpo
    h, w, b = leaf(hidden), leaf(weight), leaf(bias)
    loss, metrics = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, b, **KW, **kw)
    loss.backward()
    return [loss.detach(), *metrics.values(), h.grad, w.grad, b.grad]


def logits_loss(head, grpo):
    hidden, weight, bias, ids = head
    mask, adv, old, ref = grpo
    x = leaf(hidden @ weight.T + bias)
    loss, metrics = gk.grpo_loss(x, ids, adv, mask, old, ref, **KW)
    loss.backward()
    return [loss.detach(), *metrics.values(), x.grad]


def on_torch(fn, *args, **kw):
    with gk.force_backend("chunked"):
        return fn(*args, **kw)


def assert_equal(ours, want):
    assert len(ours) == len(want)
    for o, w in zip(ours, want):
        assert torch.equal(o, w), (o, w)


def fallback_warnings(record):
    return [w for w in record if issubclass(w.category, fallback.KernelFallbackWarning)]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.usefixtures("recompute_tiles")  # the fallback runs the operator: no kept tile
def test_forward_compile_failure_falls_back_to_the_torch_path(monkeypatch, level):
    """token: the fused forward (GRPO epilogue inside the kernel) re-runs unfused on PyTorch;
    sequence: the plain forward falls back. Both give the torch path's numbers exactly."""
    head, grpo = batch()
    want = on_torch(linear_loss, head, grpo, importance_sampling_level=level)
    kernel = FailingKernel(compile_error())
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel", kernel)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = linear_loss(head, grpo, importance_sampling_level=level)
        second = linear_loss(head, grpo, importance_sampling_level=level)  # remembered: no retry
    assert_equal(first, want)
    assert_equal(second, want)
    assert kernel.launches == 1
    (warning,) = fallback_warnings(record)
    text = str(warning.message)
    assert "CompilationError" in text and "unsupported layout conversion" in text
    assert fallback.STRICT_ENV in text


def test_backward_launch_failure_falls_back_for_that_op(monkeypatch):
    """Forward on Triton, the atomic backward fails (shared memory): the chunked backward takes
    the Triton forward's statistics; gradients agree with the torch path to float32 rounding."""
    head, grpo = batch(seed=1)
    want = on_torch(linear_loss, head, grpo)
    for module, name in ((linear_backward_atomic, "_linear_logprob_bwd_kernel"),
                         (linear_backward_gemm, "_linear_dz_kernel")):  # either backward
        monkeypatch.setattr(module, name,
                            FailingKernel(OutOfResources(300000, 232448, "shared memory")))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = linear_loss(head, grpo)
    (warning,) = fallback_warnings(record)
    assert "OutOfResources" in str(warning.message) and "shared memory" in str(warning.message)
    for o, w in zip(ours, want):
        assert torch.allclose(o, w, rtol=1e-5, atol=1e-6), (o, w)


def test_selective_logprobs_and_logits_paths_fall_back(monkeypatch):
    head, grpo = batch(seed=2)
    hidden, weight, bias, ids = head
    want = on_torch(gk.selective_logprobs, hidden, weight, ids, bias, return_entropy=True)
    want_logits = on_torch(logits_loss, head, grpo)
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel",
                        FailingKernel(compile_error()))
    monkeypatch.setattr(logits_logprobs, "_logits_logprob_fwd_kernel",
                        FailingKernel(compile_error()))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = gk.selective_logprobs(hidden, weight, ids, bias, return_entropy=True)
        ours_logits = logits_loss(head, grpo)
    assert_equal(list(ours), list(want))
    assert_equal(ours_logits, want_logits)
    families = sorted(str(w.message).split(" kernel failed")[0] for w in fallback_warnings(record))
    assert families == ["grpo_kernels: the Triton linear-head forward",
                        "grpo_kernels: the Triton logits forward with the GRPO epilogue"]


def test_strict_mode_and_forced_triton_raise(monkeypatch):
    head, grpo = batch()
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel",
                        FailingKernel(compile_error()))
    monkeypatch.setenv(fallback.STRICT_ENV, "1")
    with pytest.raises(CompilationError) as info:
        linear_loss(head, grpo)
    assert any(fallback.STRICT_ENV in note for note in getattr(info.value, "__notes__", []))
    monkeypatch.delenv(fallback.STRICT_ENV)
    with gk.force_backend("triton"), pytest.raises(CompilationError):
        linear_loss(head, grpo)
    with warnings.catch_warnings(record=True) as record:  # not strict: falls back again
        warnings.simplefilter("always")
        linear_loss(head, grpo)
    assert len(fallback_warnings(record)) == 1


@pytest.mark.parametrize("error", [
    ValueError("a bug in our launcher"),
    InterpreterError("IndexError: the interpreter's report of a kernel bug"),
    RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
], ids=["our-bug", "interpreter", "illegal-memory-access"])
def test_other_errors_are_not_hidden(monkeypatch, error):
    head, grpo = batch()
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel", FailingKernel(error))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(type(error)):
            linear_loss(head, grpo)
    assert not fallback_warnings(record)


def test_input_validation_errors_still_raise(monkeypatch):
    head, grpo = batch()
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel",
                        FailingKernel(compile_error()))
    hidden, weight, bias, ids = head
    with pytest.raises(ValueError, match="completion_ids"):
        linear_loss((hidden, weight, bias, ids + weight.shape[0]), grpo)


def _raise_inside_triton(error):
    """Raise `error` from a frame whose file lies in the triton package (as the driver,
    launcher or an MLIR pass would)."""
    path = os.path.join(os.path.dirname(triton.__file__), "fake_driver.py")
    code = compile("def launch(error):\n    raise error\n", path, "exec")
    namespace = {}
    exec(code, namespace)
    try:
        namespace["launch"](error)
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


def test_classification_of_driver_errors():
    driver = _raise_inside_triton(RuntimeError("PassManager::run failed"))
    assert fallback.fallback_cause(driver, on_gpu=True) == "RuntimeError: PassManager::run failed"
    assert fallback.fallback_cause(driver, on_gpu=False) is None  # interpreter: a kernel bug
    poisoned = _raise_inside_triton(RuntimeError("CUDA error: an illegal memory access was "
                                                 "encountered"))
    assert fallback.fallback_cause(poisoned, on_gpu=True) is None
    assert fallback.fallback_cause(RuntimeError("ours"), on_gpu=True) is None
    wrapped = RuntimeError("launch failed")
    wrapped.__cause__ = compile_error()
    assert fallback.fallback_cause(wrapped, on_gpu=False).startswith("CompilationError")
    oom = OutOfResources(300000, 232448, "shared memory")
    assert fallback.fallback_cause(oom, on_gpu=True).startswith("OutOfResources")
