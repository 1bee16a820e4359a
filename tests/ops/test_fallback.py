"""The safety net (grpo_kernels/ops/fallback.py): a Triton kernel that fails to compile or launch is
replaced by the chunked PyTorch path with one warning naming the variant and the cause;
GRPO_KERNELS_STRICT=1 and force_backend("triton") raise instead; errors that are not compile/launch
failures (bad input, a bug in our code, the interpreter's report of a kernel bug, a poisoned CUDA
context, running out of memory) propagate. Only the failed variant falls back (other dtypes,
epilogue kinds and the backward stay on Triton), each fallen-back call is counted
(`fallback_counts`), and a failed variant is tried once more after `RETRY_AFTER` calls.

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
from grpo_kernels import loss_specs
from grpo_kernels.kernels import (
    linear_backward_atomic,
    linear_backward_gemm,
    linear_logprobs,
    logits_logprobs,
)
from grpo_kernels.kernels.epilogue import EPILOGUE, KIND_SHIFT
from grpo_kernels.ops import fallback, route

pytestmark = pytest.mark.usefixtures("one_thread")
KW = dict(beta=0.04, loss_type="dapo", epsilon_high=0.28, entropy_coef=0.01)


class FailingKernel:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` raises `error`, for the launches
    that `when(args, kwargs)` selects (all by default) and at most `times` times (always by
    default); the other launches run the real kernel `real`. `launches` counts every launch."""

    def __init__(self, error, real=None, when=None, times=None):
        self.error, self.real, self.when, self.times = error, real, when, times
        self.launches = self.failures = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            selected = self.when is None or self.when(args, kwargs)
            if selected and (self.times is None or self.failures < self.times):
                self.failures += 1
                raise self.error
            return self.real[grid](*args, **kwargs)
        return launch


def failing_forward(monkeypatch, error=None, **kw) -> FailingKernel:
    """The linear head's forward kernel replaced by a FailingKernel around the real one."""
    kernel = FailingKernel(error or compile_error(), linear_logprobs._linear_logprob_fwd_kernel,
                           **kw)
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel", kernel)
    return kernel


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """No earlier failure; the four-pass route (its kernels are the ones these tests fail; the
    three-pass route's fallback has its own test at the end)."""
    monkeypatch.delenv(fallback.STRICT_ENV, raising=False)
    monkeypatch.setenv(route.ENV, "0")
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
    loss, metrics = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, b, **{**KW, **kw})
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


FORWARD = "linear-head/forward/cpu/float32/bias"
BACKWARD = "linear-head/backward/cpu/float32/bias/d=hidden+weight+bias/g_entropy"
# dapo, beta > 0, the KL times the ratio (the default)
FUSED = "linear-head/forward+epilogue:clipped+old+kl+bias_correct_kl/cpu/float32/bias"


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.usefixtures("recompute_tiles")  # the fallback runs the operator: no kept tile
def test_forward_compile_failure_falls_back_to_the_torch_path(monkeypatch, level):
    """token: the fused forward (GRPO epilogue inside the kernel) re-runs unfused on PyTorch, and
    the backward, a variant of its own, stays on Triton; sequence: the plain forward falls back
    and its backward follows it. Loss and metrics are the torch path's exactly."""
    head, grpo = batch()
    want = on_torch(linear_loss, head, grpo, importance_sampling_level=level)
    kernel = FailingKernel(compile_error())
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel", kernel)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = linear_loss(head, grpo, importance_sampling_level=level)
        second = linear_loss(head, grpo, importance_sampling_level=level)  # remembered: no retry
    for ours in (first, second):
        assert_equal(ours[:-3], want[:-3])
        if level == "sequence":
            assert_equal(ours[-3:], want[-3:])
        else:  # the Triton backward from the chunked forward's statistics
            for o, w in zip(ours[-3:], want[-3:]):
                assert torch.allclose(o, w, rtol=1e-5, atol=1e-6), (o, w)
    assert kernel.launches == 1
    counts = {FUSED: 2} if level == "token" else {FORWARD: 2, BACKWARD: 2}
    assert fallback.fallback_counts() == counts
    (warning,) = fallback_warnings(record)
    text = str(warning.message)
    assert "CompilationError" in text and "unsupported layout conversion" in text
    assert f"kernel {FUSED if level == 'token' else FORWARD} failed" in text
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
    assert_equal(ours_logits[:-1], want_logits[:-1])  # d logits: from the Triton backward
    assert torch.allclose(ours_logits[-1], want_logits[-1], rtol=1e-5, atol=1e-6)
    named = sorted(str(w.message).split(" failed")[0] for w in fallback_warnings(record))
    logits = "logits/forward+epilogue:clipped+old+kl+bias_correct_kl/cpu/float32"
    assert named == [f"grpo_kernels: the Triton kernel {FORWARD}",
                     f"grpo_kernels: the Triton kernel {logits}"]
    assert fallback.fallback_counts() == {FORWARD: 1, logits: 1}


def is_cispo_epilogue(args, kwargs) -> bool:
    flags = kwargs["EPI_FLAGS"]
    cispo = loss_specs.CISPO.kernel_code
    return bool(flags & EPILOGUE.value) and flags >> KIND_SHIFT.value == cispo


def test_a_failed_variant_leaves_the_others_on_triton(monkeypatch):
    """The fused forward of cispo cannot be built: cispo re-runs unfused on PyTorch, while dapo's
    fused forward, the plain forward and the backward keep running their Triton kernels."""
    head, grpo = batch(seed=3)
    hidden, weight, bias, ids = head
    kernel = failing_forward(monkeypatch, when=is_cispo_epilogue)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            linear_loss(head, grpo, loss_type="cispo")
        launches = kernel.launches
        dapo = linear_loss(head, grpo)
        assert kernel.launches == launches + 1  # the fused dapo forward ran on Triton
        sequence = linear_loss(head, grpo, loss_type="cispo", importance_sampling_level="sequence")
        gk.selective_logprobs(hidden, weight, ids, bias)
    assert kernel.failures == 1 and kernel.launches == launches + 3
    cispo = "linear-head/forward+epilogue:cispo+old+kl+bias_correct_kl/cpu/float32/bias"
    assert fallback.fallback_counts() == {cispo: 3}  # its backward: on Triton
    (warning,) = fallback_warnings(record)
    assert f"kernel {cispo} failed" in str(warning.message)
    for ours, want in ((dapo, on_torch(linear_loss, head, grpo)),
                       (sequence, on_torch(linear_loss, head, grpo, loss_type="cispo",
                                           importance_sampling_level="sequence"))):
        for o, w in zip(ours, want):
            assert torch.allclose(o, w, rtol=1e-5, atol=1e-6), (o, w)


def test_a_failed_dtype_leaves_the_other_dtypes_on_triton(monkeypatch):
    head, _ = batch(seed=4)
    hidden, weight, bias, ids = head
    kernel = failing_forward(monkeypatch, when=lambda args, kw: args[0].dtype == torch.float32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gk.selective_logprobs(hidden, weight, ids, bias)
        half = [t.bfloat16() for t in (hidden, weight, bias)]
        ours = gk.selective_logprobs(half[0], half[1], ids, half[2])
        gk.selective_logprobs(hidden, weight, ids, bias)
    assert kernel.launches == 2 and kernel.failures == 1  # bfloat16 launched, float32 did not
    assert fallback.fallback_counts() == {FORWARD: 2}
    assert len(fallback_warnings(record)) == 1
    want = on_torch(gk.selective_logprobs, half[0], half[1], ids, half[2])
    assert torch.allclose(ours, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("times", [1, None], ids=["transient", "broken"])
def test_a_failed_variant_is_tried_once_more(monkeypatch, times):
    """The failing call and the next RETRY_AFTER calls run on the fallback, then the kernel is
    tried again: a transient failure is over (Triton from then on), a broken kernel fails again
    and stays on the fallback without further compile attempts. Every fallen-back call counts."""
    monkeypatch.setattr(fallback, "RETRY_AFTER", 2)
    head, _ = batch(seed=5)
    hidden, weight, bias, ids = head
    kernel = failing_forward(monkeypatch, times=times)
    counts = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(8):
            gk.selective_logprobs(hidden, weight, ids, bias)
            counts.append(fallback.fallback_counts().get(FORWARD, 0))
    if times == 1:  # calls 1-3 on the fallback, the retry (call 4) and the rest on Triton
        assert counts == [1, 2, 3, 3, 3, 3, 3, 3] and kernel.launches == 6
    else:  # the retry fails: every call on the fallback, two launches in all
        assert counts == [1, 2, 3, 4, 5, 6, 7, 8] and kernel.launches == 2
    assert len(fallback_warnings(record)) == 1  # once per variant, retry or not
    assert "the next 2 calls" in str(fallback_warnings(record)[0].message)


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
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    MemoryError(),
], ids=["our-bug", "interpreter", "illegal-memory-access", "cuda-oom", "host-oom"])
def test_other_errors_are_not_hidden(monkeypatch, error):
    head, grpo = batch()
    monkeypatch.setattr(linear_logprobs, "_linear_logprob_fwd_kernel", FailingKernel(error))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(type(error)):
            linear_loss(head, grpo)
    assert not fallback_warnings(record) and not fallback.fallback_counts()


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
    oom = OutOfResources(300000, 232448, "shared memory")  # a tile too large for this GPU
    assert fallback.fallback_cause(oom, on_gpu=True).startswith("OutOfResources")
    for error in (torch.cuda.OutOfMemoryError("CUDA out of memory"), MemoryError()):
        assert fallback.fallback_cause(_raise_inside_triton(error), on_gpu=True) is None


THREE_PASS = "linear-head/three-pass+epilogue:clipped+old+kl+bias_correct_kl/cpu/float32/bias"


def test_the_three_pass_route_falls_back_to_its_chunked_twin(monkeypatch):
    """The Triton three-pass route's row kernel fails to build: the call runs the chunked
    three-pass computation (same contract) under the route's own variant key, with one warning;
    strict mode raises instead."""
    monkeypatch.setenv(route.ENV, "1")
    head, grpo = batch(seed=4)
    want = on_torch(linear_loss, head, grpo)
    kernel = FailingKernel(compile_error())
    monkeypatch.setattr(logits_logprobs, "_logits_logprob_fwd_kernel", kernel)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = linear_loss(head, grpo)
    (warning,) = fallback_warnings(record)
    assert f"kernel {THREE_PASS} failed" in str(warning.message)
    assert fallback.fallback_counts() == {THREE_PASS: 1}
    assert_equal(ours, want)
    monkeypatch.setenv(fallback.STRICT_ENV, "1")
    with pytest.raises(CompilationError):
        linear_loss(head, grpo)
