"""The logit transform some models apply inside their forward, as Triton functions that the
kernels call on each float32 logit tile (and its derivative for the backward kernels):

    y = hidden @ weight.T + bias (or the logits given)      raw logits
    z = c·tanh(s·y / c)   with a soft cap c and a scale s    (Gemma 2: s = 1, c = 30)
    z = s·y               with a scale only                  (Cohere's logit_scale)
    then the temperature: logits z / τ, softmax

The scale comes first, then the cap, then the temperature, as a model's forward produces its
logits and TRL divides them by τ afterwards. The flags are constexprs: with neither, the kernels'
code is what it was without a transform. Gradient algebra in `softcap_logits_grad`.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# tl.fdiv's `approx` keyword (div.approx.f32) is newer than Triton 3.4, whose fdiv without IEEE
# rounding is already the fast full-range division (div.full.f32, 2 ulp): no slow path either way
FDIV_HAS_APPROX = tl.constexpr("approx" in inspect.signature(tl.fdiv).parameters)


@triton.jit
def _tanh_and_sech2(a):
    """(tanh a, 1 - tanh² a) from one exp2 of -2|a|, both without cancellation:
        e = e^(-2|a|) in (0, 1],  tanh|a| = (1 - e) / (1 + e),  1 - tanh² a = 4e / (1 + e)²
    (e underflows to 0 for large |a|: tanh = ±1, 1 - tanh² = 0, no inf/inf). Triton has no
    tanh of its own that its interpreter also runs; 1 - e loses relative precision only where
    |a| is tiny, an absolute error of a few float32 ulps of 1, i.e. of c·ulp(1) in the capped
    logit c·tanh, the size of the rounding of a logit near the cap itself. The one division is
    the approximate one (2 ulp; its denominator 1 + e lies in [1, 2]): IEEE division adds a
    slow-path call whose registers made the fused forward and d-logits kernels spill."""
    e = tl.exp2(tl.abs(a) * (-2.0 * LOG2E))
    if FDIV_HAS_APPROX:  # 1 + e in [1, 2]: 2 ulp, no slow-path call
        r = tl.fdiv(1.0, 1.0 + e, approx=True)
    else:
        r = tl.fdiv(1.0, 1.0 + e)
    t = (1.0 - e) * r
    return tl.where(a < 0, -t, t), 4.0 * e * r * r


@triton.jit
def softcap_logits(y, logit_mul, softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The model's logits from raw ones y = hidden @ weight.T + bias (float32, any shape):
        HAS_SOFTCAP:  z = c·tanh(s·y / c)     (logit_mul = s / c, softcap = c; s = 1 if unset)
        HAS_SCALE:    z = s·y                  (logit_mul = s; a scale without a cap)
        neither:      z = y                    (no instruction: the plain kernels)
    `logit_transform_args` makes the arguments."""
    z = y
    if HAS_SOFTCAP:
        t, _ = _tanh_and_sech2(y * logit_mul)
        z = t * softcap
    elif HAS_SCALE:
        z = y * logit_mul
    return z


@triton.jit
def softcap_logits_grad(y, logit_mul, softcap, HAS_SCALE: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr):
    """(z, dz/dy) of `softcap_logits` (only called with a transform on). Gradient algebra:
        z = c·tanh(u), u = s·y / c:  dz/dy = c·(1 - tanh² u)·(s / c) = s·(1 - tanh² u)
                                           = s·(1 - (z / c)²)   (1 - tanh² from _tanh_and_sech2)
        z = s·y:                     dz/dy = s
    The backward kernels then chain d loss / dy = (d loss / dz)·dz/dy elementwise, before the
    products with hidden and weight (d hidden = dy @ W, d weight = dy^T @ hidden, d bias = Σ dy)."""
    if HAS_SOFTCAP:
        t, sech2 = _tanh_and_sech2(y * logit_mul)
        z = t * softcap
        dzdy = sech2 * (logit_mul * softcap)  # s·(1 - tanh²), s = logit_mul·c
    else:
        z = y * logit_mul
        dzdy = logit_mul  # s, a scalar (a tile of it would take a register per element)
    return z, dzdy


def logit_transform_args(softcap: float | None, logit_scale: float | None) -> dict:
    """The kernels' arguments of the logit transform z = cap(s·y) (`softcap_logits`): the
    runtime scalars logit_mul, softcap and the constexprs HAS_SCALE, HAS_SOFTCAP. With a cap,
    the scale rides in logit_mul = s / c (HAS_SCALE stays False: one variant per cap); with
    neither, the flags are off and the kernels compile as they did without a transform."""
    s = 1.0 if logit_scale is None else float(logit_scale)
    if softcap is not None:
        return dict(logit_mul=s / float(softcap), softcap=float(softcap), HAS_SCALE=False,
                    HAS_SOFTCAP=True)
    return dict(logit_mul=s, softcap=1.0, HAS_SCALE=logit_scale is not None, HAS_SOFTCAP=False)


def grad_filter_scale(logit_scale: float | None) -> float:
    """|s|: the most dz/dy can be (1 - tanh² <= 1), by which a filtered backward scales its
    threshold, so that eps keeps meaning "relative to the token's largest d logit"."""
    return 1.0 if logit_scale is None else abs(float(logit_scale))
