"""Compatibility guards (docs/compatibility.md): every runtime `range()` bound in a kernel goes
through `loop_bound` (Triton 3.4-3.6's interpreter cannot take a bare one with NumPy >= 2.4,
which the main environment's Triton 3.9 does not show), and an old torch is refused in one line."""

import ast
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import grpo_kernels
from grpo_kernels.kernels import (
    accumulate_mm,
    epilogue,
    linear_backward_gemm,
    linear_logprobs,
    logits_logprobs,
    precision,
)
from grpo_kernels.ops import torch_check

KERNEL_MODULES = [accumulate_mm, epilogue, linear_backward_gemm, linear_logprobs,
                  logits_logprobs, precision]
ROOT = pathlib.Path(grpo_kernels.__file__).parents[1]


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


def test_old_torch_is_refused_in_one_line():
    for fine in ("2.8.0", "2.8.0+cu128", "2.13.0+cpu", "2.14.1+cu130", "2.15.0+cu132"):
        torch_check.check(fine)
    with pytest.raises(ImportError) as err:
        torch_check.check("2.7.1+cu126")
    assert str(err.value) == "grpo-kernels needs torch>=2.8,<2.16; found torch 2.7.1+cu126"


def test_range_is_pyproject_s():
    tomllib = pytest.importorskip("tomllib")
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip("installed without its pyproject.toml")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split("#")[0].strip() == f"torch{torch_check.TORCH_RANGE}" for d in deps), deps


def test_importing_the_losses_on_an_old_torch_fails_in_one_line():
    # `import grpo_kernels` itself loads only GRPOParams; the losses load the op layer
    code = ("import torch\ntorch.__version__ = '2.6.0'\n"
            "try:\n    from grpo_kernels import fused_linear_grpo_loss\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=os.environ)
    assert out.stdout.strip() == "grpo-kernels needs torch>=2.8,<2.16; found torch 2.6.0", out


def test_traced_entry_points_take_hyperparameters_without_locals():
    """torch.compile of torch 2.4-2.8 cannot trace locals(): the functions a user compiles take
    the hyperparameters as **hyperparameters (GRPOParams.resolve), never from locals()."""
    from grpo_kernels import functional, reference

    for fn in (functional.fused_linear_grpo_loss, functional.grpo_loss,
               reference.fused_linear_grpo_loss, reference.grpo_loss):
        tree = ast.parse(inspect.getsource(fn).lstrip())
        calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
        if "_resolve" in calls:  # fused_linear_grpo_loss resolves them in a helper
            helper = ast.parse(inspect.getsource(functional._resolve))
            calls += [ast.unparse(n.func) for n in ast.walk(helper) if isinstance(n, ast.Call)]
        assert "locals" not in calls, fn.__qualname__
        assert "GRPOParams.resolve" in calls, fn.__qualname__


def test_ci_runs_the_newest_admitted_torch():
    """.ci/run's NEWEST_TORCH is a release of the newest minor version pyproject admits, so that
    widening the range without moving CI (or the reverse) fails here."""
    ci = ROOT / ".ci" / "run"
    if not ci.exists():
        pytest.skip("installed without .ci/run")
    newest = re.search(r"^NEWEST_TORCH=(\d+)\.(\d+)\.\d+$", ci.read_text(), re.M)
    upper = re.search(r"<(\d+)\.(\d+)$", torch_check.TORCH_RANGE)
    assert newest and upper, (newest, upper)
    assert (int(newest[1]), int(newest[2]) + 1) == (int(upper[1]), int(upper[2])), (
        newest[0], torch_check.TORCH_RANGE)
