"""Precision policy of the Triton dots, and the dots that the kernels share.

float32 inputs follow PyTorch's float32 matmul setting (read so that it can never raise):
    "highest" / "ieee"        -> input_precision "tf32x3": three TF32 tensor-core products
                                 (a_big·b_big + a_big·b_small + a_small·b_big), each operand
                                 split as big = tf32(a), small = tf32(a - big); about float32
                                 accuracy (the dropped small·small term is ~2^-22 relative)
    "high" / "medium" / "tf32" -> "tf32": one product of operands cut to 10 mantissa bits
                                 (relative error below 2^-10 per operand, so a logit is off by
                                 up to ~2·2^-10·Σ_d |h_d·w_d|). Measured with an interpreter
                                 emulation of TF32 truncation (tests/conftest.py), on random
                                 logits of spread ~8 over D = 256 (tests/kernels/test_precision.py):
                                 logp off by 3.5e-2 with "tf32", 6.6e-6 with "tf32x3".
Triton 3.4.0, 3.6.0 and 3.9.0 accept "tf32x3" and compile it for sm_75 (plain FMA there), sm_80
and sm_90 (mma); checked with `triton.compile` on this CPU machine.

16-bit inputs always run the tensor cores (their products are exact in float32, accumulation is
float32). A 16-bit hidden with a float32 head weight (mixed head precision) uses `split_dot`.

Triton's interpreter (TRITON_INTERPRET=1) multiplies the raw bit patterns of bfloat16 operands in
`tl.dot` (bfloat16 is stored as uint16 there). `INTERPRETER_UPCASTS_BF16` is True when that is so
(the interpreter is on and its dot gives a wrong bf16 product); `tile_dot` then upcasts bf16
operands to float32 first, which is exact. On a GPU it is False and `tile_dot` is plain `tl.dot`.
The tests install a correct bf16 dot in the interpreter (tests/conftest.py), so they run the plain
`tl.dot` on bf16 that the GPU runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _flag(read) -> str | None:
    try:
        value = read()
    except Exception:  # any torch version, any mix of legacy and new APIs: never raise
        return None
    return value if isinstance(value, str) else None


def fp32_matmul_mode() -> str:
    """"ieee" or "tf32": PyTorch's current float32 matmul precision for CUDA. Never raises.

    The per-backend flag (torch >= 2.9: torch.backends.cuda.matmul.fp32_precision, "none" defers
    to torch.backends.fp32_precision) is read first: it reflects both APIs and does not raise
    after a mix of them, whereas torch.get_float32_matmul_precision() and
    torch.backends.cuda.matmul.allow_tf32 do. Older torch has only the legacy setting."""
    for read in (lambda: torch.backends.cuda.matmul.fp32_precision,
                 lambda: torch.backends.fp32_precision):
        value = _flag(read)
        if value in ("ieee", "tf32"):
            return value
    legacy = _flag(torch.get_float32_matmul_precision)
    if legacy in ("high", "medium"):
        return "tf32"
    return "ieee"  # "highest", or nothing readable: the accurate choice


def dot_precision(dtype: torch.dtype) -> str:
    """The `input_precision` of the kernels' dots for inputs of `dtype` (see the module doc)."""
    if dtype == torch.float32 and fp32_matmul_mode() == "ieee":
        return "tf32x3"
    return "tf32"  # float32 under "high"/"medium"; ignored by Triton for 16-bit operands


def _interpreter_bf16_dot_is_wrong() -> bool:
    """Multiplies 1.5 by 1.5 in bfloat16 with the interpreter's own dot (no kernel launch).
    True when the answer is not 2.25, or when the check itself fails (then upcasting is the
    safe choice)."""
    try:
        import numpy as np
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

        one_and_half = TensorHandle(np.full((1, 1), 0x3FC0, dtype=np.uint16), tl.bfloat16)
        zero = TensorHandle(np.zeros((1, 1), dtype=np.float32), tl.float32)
        out = InterpreterBuilder().create_dot(one_and_half, one_and_half, zero, None, 0)
        return float(np.asarray(out.data).reshape(-1)[0]) != 2.25
    except Exception:
        return True


# Read by `tile_dot` at trace time (a constexpr global, so the GPU build has no branch).
INTERPRETER_UPCASTS_BF16 = tl.constexpr(
    os.environ.get("TRITON_INTERPRET") == "1" and _interpreter_bf16_dot_is_wrong())


@triton.jit
def tile_dot(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b: a [M, K], b [K, N] of one dtype, acc [M, N] float32."""
    if INTERPRETER_UPCASTS_BF16:
        if a.dtype == tl.bfloat16:  # exact: every bfloat16 is a float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _split(y, x):
    """y float32 -> (hi, lo, x in the dot format): x is exact in that format, y = hi + lo + r."""
    if x.dtype == tl.bfloat16:
        hi = y.to(tl.bfloat16)
        lo = (y - hi.to(tl.float32)).to(tl.bfloat16)
        x_in = x
    else:  # float16 x is exact in TF32 (10 mantissa bits): split y at TF32's precision
        hi = (y.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        lo = y - hi
        x_in = x.to(tl.float32)
    return hi, lo, x_in


@triton.jit
def split_dot(x, y, acc, Y_FIRST: tl.constexpr):
    """acc + x @ y (or acc + y @ x with Y_FIRST) for a 16-bit x and a float32 y, on the tensor
    cores with about 16 (bfloat16 x) or 20 (float16 x) significant bits of y instead of
    float32's 24. x is exact in the dot's input format; y is split into two pieces of that
    format, y = hi + lo + r, and the dot takes x·hi + x·lo:
      bfloat16 x: hi = bf16(y), lo = bf16(y - hi); two bf16 products, |r| <= 2^-16·|y|
      float16 x:  hi = y with its low 13 mantissa bits cleared, lo = y - hi; two TF32
                  products (the hardware keeps lo's top 11 bits), |r| < 2^-20·|y|."""
    hi, lo, x_in = _split(y, x)
    if Y_FIRST:
        acc = tile_dot(hi, x_in, acc, "tf32")
        acc = tile_dot(lo, x_in, acc, "tf32")
    else:
        acc = tile_dot(x_in, hi, acc, "tf32")
        acc = tile_dot(x_in, lo, acc, "tf32")
    return acc


@triton.jit
def head_dot(x, y, acc, DOT_PREC: tl.constexpr):
    """acc + x @ y where y holds head-weight values: one dot when x and y share a dtype, the
    split dot when x is 16-bit and y float32 (mixed head precision)."""
    if x.dtype == y.dtype:
        acc = tile_dot(x, y, acc, DOT_PREC)
    else:
        acc = split_dot(x, y, acc, False)
    return acc
