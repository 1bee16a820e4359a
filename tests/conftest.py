"""Test set-up: without a CUDA device, CPU tensors run the real Triton kernels through Triton's
interpreter, which must be switched on before triton is first imported.

One correction makes the interpreter compute what a GPU computes (`patch_interpreter`):
`tl.dot` of the GPU's numerics: bfloat16 operands (stored as uint16 bit patterns in the
interpreter, which multiplies the raw integers: -2.7e9 where the answer is -2.5) are widened to
float32 first, exactly; float32 operands are rounded as the tensor cores round them for the
dot's `input_precision`: "tf32" keeps 10 mantissa bits (truncation: the low 13 bits are
dropped, the worse of the two rounding modes a GPU may use), "tf32x3" sums the three TF32
products of Triton's split (big = tf32(a), small = tf32(a - big), round to nearest), "ieee" is
exact float32. Products accumulate in float32 as on the GPU. tests/kernels/test_precision.py
checks it.

Nothing else is patched: the kernels' runtime `range()` bounds go through `loop_bound`
(grpo_kernels/kernels/linear_logprobs.py), so they run in the interpreter of Triton 3.4-3.6 with
NumPy >= 2.4 as a user's TRITON_INTERPRET=1 run does.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _tf32(x, rounding: str):
    """float32 array -> the nearest value with TF32's 10 mantissa bits (as float32)."""
    import numpy as np

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if rounding == "nearest":  # ties away from zero, as cvt.rna.tf32.f32
        bits = bits + np.uint32(0x1000)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


def gpu_dot(a, b, precision: str):
    """a @ b of float32 arrays as the tensor cores compute it for `precision`."""
    import numpy as np

    if precision == "tf32":
        return np.matmul(_tf32(a, "truncate"), _tf32(b, "truncate"))
    if precision == "tf32x3":
        a_big, b_big = _tf32(a, "nearest"), _tf32(b, "nearest")
        a_small, b_small = _tf32(a - a_big, "nearest"), _tf32(b - b_big, "nearest")
        return (np.matmul(a_small, b_big) + np.matmul(a_big, b_small)) + np.matmul(a_big, b_big)
    return np.matmul(a, b)


def patch_interpreter():
    """Installs the correction above (idempotent). Returns the interpreter's own
    create_dot, which tests/kernels/test_precision.py uses to show the bf16 bug."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if hasattr(builder.create_dot, "native"):
        return builder.create_dot.native
    native = builder.create_dot

    def as_float32(x):
        if x.dtype.scalar == tl.bfloat16:  # uint16 bits -> the float32 with the same value
            return (x.data.astype(np.uint32) << 16).view(np.float32)
        return x.data.astype(np.float32) if x.data.dtype != np.float32 else x.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.dtype.scalar != tl.float32 or not (a.dtype.scalar.is_floating()
                                                and a.dtype.scalar.primitive_bitwidth >= 16):
            return native(self, a, b, d, input_precision, max_num_imprecise_acc)
        name = str(input_precision).rsplit(".", 1)[-1].lower()  # INPUT_PRECISION.TF32x3 -> tf32x3
        is_fp32 = a.dtype.scalar == tl.float32
        out = gpu_dot(as_float32(a), as_float32(b), name if is_fp32 else "ieee")
        return interpreter.TensorHandle((out + d.data).astype(np.float32), d.dtype.scalar)

    create_dot.native = native
    builder.create_dot = create_dot
    return native


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_interpreter()


def pytest_configure(config):
    # A kernel that falls back to the PyTorch path in a test is a kernel problem hidden by the
    # safety net: make it fail (tests of the fallback itself record warnings explicitly).
    config.addinivalue_line("filterwarnings",
                            "error::grpo_kernels.ops.fallback.KernelFallbackWarning")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for modules of tiny ops: on a busy 2-core machine extra threads spin
    against other processes and make tiny ops 10-100x slower. Opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def recompute_tiles(monkeypatch):
    """Eager calls on the chunked backend recompute the linear head's logits in the backward,
    and read the logits path's p through the lse, as the operator that a compiled graph calls
    does, so that compiled and eager gradients can be compared bitwise (from a tile or the
    statistics kept by the forward they differ by float32 rounding; see
    tests/ops/test_torch_compile.py). The linear-head loss takes the four-pass route there too
    (GRPO_KERNELS_THREE_PASS=0), for the same reason: the three-pass route's gradients come
    from the forward's chunks, equal to the four-pass route's to float32 rounding."""
    from grpo_kernels import chunked
    from grpo_kernels.chunked import linear_launchers
    from grpo_kernels.ops import route

    monkeypatch.setattr(linear_launchers, "KEEP_ELEMENTS", 0)
    logits_forward = chunked.logits_logprob_forward  # called without `keep`: nothing kept
    monkeypatch.setattr(chunked, "logits_logprob_forward",
                        lambda *args, keep=None, **kw: logits_forward(*args, **kw))
    monkeypatch.setenv(route.ENV, "0")
