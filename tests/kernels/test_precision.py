"""Dot precision: the float32 policy (never raises, follows PyTorch's setting), the interpreter's
bf16 dot (wrong natively, right under tests/conftest.py's patch, and never garbage for a user
without the patch), the TF32 error against float64, and the mixed-precision split dot."""

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import gpu_dot, patch_interpreter
from helpers import make_head, max_err
from triton.runtime import interpreter

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.kernels import precision
from grpo_kernels.kernels.linear_logprobs import loop_bound
from grpo_kernels.ops import route

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs kernels in Triton's interpreter")


def _has_new_api() -> bool:
    """torch >= 2.9: the per-backend flags (torch.backends.cuda.matmul.fp32_precision)."""
    try:
        torch.backends.cuda.matmul.fp32_precision  # noqa: B018
    except AttributeError:
        return False
    return True


NEW_API = _has_new_api()


@pytest.fixture
def restore_matmul_flags():
    """Puts PyTorch's float32 matmul flags back as they were (the default: "highest")."""
    legacy = torch.get_float32_matmul_precision()
    yield
    if NEW_API:
        torch.backends.fp32_precision = "none"
        torch.backends.cuda.matmul.fp32_precision = "none"
    torch.set_float32_matmul_precision(legacy)
    if NEW_API:
        torch.backends.cuda.matmul.fp32_precision = "none"


def _set_new(value, generic=False):
    def apply():
        if generic:
            torch.backends.fp32_precision = value
        else:
            torch.backends.cuda.matmul.fp32_precision = value
    return apply


def _legacy(value):
    return lambda: torch.set_float32_matmul_precision(value)


def _allow_tf32():
    torch.backends.cuda.matmul.allow_tf32 = True


SETTINGS = {  # name: (steps, the input_precision float32 must get)
    "default": ([], "tf32x3"),
    "new tf32": ([_set_new("tf32")], "tf32"),
    "new ieee": ([_set_new("ieee")], "tf32x3"),
    "generic tf32": ([_set_new("tf32", generic=True)], "tf32"),
    "legacy high": ([_legacy("high")], "tf32"),
    "legacy medium": ([_legacy("medium")], "tf32"),
    "legacy highest": ([_legacy("highest")], "tf32x3"),
    "allow_tf32": ([_allow_tf32], "tf32"),
    "legacy high, then new ieee": ([_legacy("high"), _set_new("ieee")], "tf32x3"),
    "generic tf32, then cuda ieee": ([_set_new("tf32", generic=True), _set_new("ieee")],
                                     "tf32x3"),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_fp32_policy_follows_torch_and_never_raises(name, restore_matmul_flags):
    if not NEW_API and ("new" in name or "generic" in name):
        pytest.skip("torch < 2.9 has only the legacy float32 matmul setting")
    steps, expected = SETTINGS[name]
    for step in steps:
        step()
    assert precision.dot_precision(torch.float32) == expected
    assert precision.dot_precision(torch.bfloat16) == "tf32"  # 16-bit: ignored by Triton
    if name == "new tf32":  # the crash this guards: the legacy getters raise in this state
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.backends.cuda.matmul.allow_tf32  # noqa: B018
        hidden, weight, _, ids = make_head(1, 5, 8, 40, torch.float32, "cpu")
        with gk.force_backend("triton"):
            logp = gk.selective_logprobs(hidden, weight, ids)
        assert max_err(logp, reference.selective_logprobs(hidden, weight, ids)) < 1e-2


def test_fp32_policy_survives_broken_getters(monkeypatch):
    def boom(*args):
        raise RuntimeError("unreadable")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", boom)
    monkeypatch.setattr(torch.backends.cuda, "matmul", object())  # no fp32_precision attribute
    assert precision.dot_precision(torch.float32) == "tf32x3"


def test_gpu_dot_emulation_rounds_like_tf32():
    one_plus = np.float32(1 + 2.0**-12)  # below TF32's last mantissa bit (2^-10)
    a = np.array([[one_plus]], dtype=np.float32)
    b = np.ones((1, 1), dtype=np.float32)
    assert gpu_dot(a, b, "tf32")[0, 0] == 1.0
    assert gpu_dot(a, b, "tf32x3")[0, 0] == one_plus
    assert gpu_dot(a, b, "ieee")[0, 0] == one_plus


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, n, PREC: tl.constexpr):
    # [16, 16] @ [16, 16]; the loop has a runtime bound, as the kernels' loops (loop_bound)
    r = tl.arange(0, 16)
    for _i in range(0, loop_bound(n)):
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b, input_precision=PREC))


def _bf16_dot(monkeypatch, native: bool):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    c = torch.empty(16, 16)
    if native:
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", patch_interpreter())
    _dot_kernel[(1,)](a, b, c, 1, "tf32")
    return max_err(c, a.double() @ b.double())


def test_interpreter_bf16_dot_is_wrong_natively_and_right_patched(monkeypatch):
    assert _bf16_dot(monkeypatch, native=False) < 1e-4  # float32 accumulation of exact products
    assert not precision._interpreter_bf16_dot_is_wrong()
    native_err = _bf16_dot(monkeypatch, native=True)
    if not precision._interpreter_bf16_dot_is_wrong():
        pytest.skip("this Triton's interpreter multiplies bf16 correctly by itself")
    assert native_err > 1e3  # the raw uint16 patterns were multiplied


def test_user_without_the_patch_gets_correct_bf16(monkeypatch):
    """A user's TRITON_INTERPRET=1 run has the interpreter's native dot: the kernels detect it
    (INTERPRETER_UPCASTS_BF16) and widen bf16 operands to float32, exactly."""
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", patch_interpreter())
    monkeypatch.setattr(precision, "INTERPRETER_UPCASTS_BF16", tl.constexpr(True))
    hidden, weight, _, ids = make_head(2, 7, 24, 70, torch.bfloat16, "cpu", seed=3, scale=4.0)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with gk.force_backend("triton"):
        logp = gk.selective_logprobs(h, w, ids)
    logp.sum().backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    truth = reference.selective_logprobs(h64, w64, ids)
    truth.sum().backward()
    assert max_err(logp, truth) < 1e-4
    assert max_err(h.grad, h64.grad) < 2e-2 * h64.grad.abs().max().item()
    assert max_err(w.grad, w64.grad) < 2e-2 * w64.grad.abs().max().item()


def _logp_err(fp32_precision: str | None):
    if fp32_precision is not None and NEW_API:
        torch.backends.cuda.matmul.fp32_precision = fp32_precision
    elif fp32_precision is not None:  # torch < 2.9: the legacy setting ("high" is TF32)
        torch.set_float32_matmul_precision({"tf32": "high", "ieee": "highest"}[fp32_precision])
    hidden, weight, _, ids = make_head(4, 32, 256, 300, torch.float32, "cpu", seed=4, scale=8.0)
    # the fused forward kernel's dot: a call without a gradient would otherwise take the
    # forward-only route, whose GEMM is the library's (TF32 on CUDA by the same setting, never
    # on the CPU, so the interpreter's emulation would not show it)
    with gk.force_backend("triton"), pytest.MonkeyPatch.context() as mp:
        mp.setenv(route.ENV, "0")
        logp = gk.selective_logprobs(hidden, weight, ids)
    truth = reference.selective_logprobs(hidden.double(), weight.double(), ids)
    return max_err(logp, truth)


def test_tf32_error_against_float64(restore_matmul_flags):
    """float32 logits over D=256 with spread ~8 nats. Measured with the interpreter's TF32
    emulation (truncation to 10 mantissa bits, tests/conftest.py): the TF32 error is far above
    float32's and below the estimate 2·2^-10·Σ_d |h_d·w_d| (two truncated operands) per logit,
    while "highest" (3xTF32) stays at float32's level."""
    exact = _logp_err(None)
    tf32 = _logp_err("tf32")
    hidden, weight, _, _ = make_head(4, 32, 256, 300, torch.float32, "cpu", seed=4, scale=8.0)
    bound = 2 * 2.0**-10 * (hidden.reshape(-1, 256).abs() @ weight.abs().T).max().item()
    assert exact < 2e-5
    assert 10 * exact < tf32 < 2 * bound, (exact, tf32, bound)
