"""Compatibility guards (docs/compatibility.md): every runtime `range()` bound in a kernel goes
through `loop_bound` (Triton 3.4-3.6's interpreter cannot take a bare one with NumPy >= 2.4,
which the main environment's Triton 3.9 does not show)."""

import ast
import inspect

import pytest

from grpo_kernels.kernels import (
    accumulate_mm,
    epilogue,
    linear_backward_gemm,
    linear_logprobs,
    logits_logprobs,
    precision,
)

KERNEL_MODULES = [accumulate_mm, epilogue, linear_backward_gemm, linear_logprobs,
                  logits_logprobs, precision]


def bare_bounds(source: str) -> list:
    """'function: range(...)' for each range() in a @triton.jit function with a bound that is
    neither a literal, a constexpr parameter, nor loop_bound(...)."""
    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef)
                and any("jit" in ast.unparse(d) for d in fn.decorator_list)):
            continue
        constexpr = {a.arg for a in fn.args.args
                     if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
        for node in ast.walk(fn):
            if not (isinstance(node, ast.For) and isinstance(node.iter, ast.Call)
                    and ast.unparse(node.iter.func) in ("range", "tl.range")):
                continue
            if not all(isinstance(arg, ast.Constant)
                       or (isinstance(arg, ast.Name) and arg.id in constexpr)
                       or (isinstance(arg, ast.Call) and ast.unparse(arg.func) == "loop_bound")
                       for arg in node.iter.args):
                bad.append(f"{fn.name}: {ast.unparse(node.iter)}")
    return bad


@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_runtime_loop_bounds_go_through_loop_bound(module):
    assert bare_bounds(inspect.getsource(module)) == []


def test_a_bare_runtime_bound_is_seen():
    src = ("@triton.jit\ndef k(n, B: tl.constexpr):\n"
           "    for i in range(0, n, B):\n        pass\n"
           "    for i in range(loop_bound(n), B):\n        pass\n")
    assert bare_bounds(src) == ["k: range(0, n, B)"]
