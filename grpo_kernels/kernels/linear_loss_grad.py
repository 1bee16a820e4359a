"""The linear head's GRPO loss and its gradient in three passes over [N, V, D] (the CUDA route).

For token-level losses L = Σ_n weight_n·ℓ_n(logp_n) + Σ_n g_H,n·H_n, row n of d L / d logits
depends on row n's logits alone. So once a chunk of C whole rows holds its logits, the GRPO
epilogue (`epilogue.py`) gives each row's coefficient c_n = weight_n·dℓ_n/dlogp_n, and the chunk's
d logits go straight into the gradient GEMMs. Per chunk of rows r:

  1. y = h[r] @ W^T (+ b)              [C, V] float32, a library GEMM (`gemm.product`)
  2. the Triton row forward with the epilogue (`logits_logprobs._logits_logprob_fwd_kernel`):
     logp, entropy, lse and weight·ℓ, c, kl, ratio per row (into the epilogue's outputs)
  3. the Triton row backward (`_logits_logprob_bwd_kernel`, g_logp = c, g_entropy = g_H):
     d y [C, V] in the GEMM dtype, written over y (`dlogits_over`), p = e^((z - m) - log s)
     read against step 2's row max m and log s (two [C] float32 per chunk), as step 2 formed it
  4. d hidden[r] = d y @ W              [C, D], one GEMM rounded once to hidden's dtype
     d W += d y^T @ h[r]                [V, D], float32 across chunks; d b += Σ_rows d y (float32)

against four passes for a forward plus a backward that recomputes the logits. Steps 2 and 3 may
run as one kernel (`fused_rows`, `logits_loss_grad.py`). With a logit
transform z = cap(s·y) / τ (`logit_transform.py`) the row kernels apply it, so d y is the
gradient of the raw logits y and the GEMMs are unchanged.

Dtypes: the GEMM dtype is the weight's (hidden's for 16-bit heads; float32 for float32 heads and
for the mixed head, 16-bit hidden with a float32 weight, whose hidden chunk is upcast). Logits
are float32 in every case (cuBLAS with a float32 output for 16-bit operands); d y is in the GEMM
dtype. Float32 GEMMs follow PyTorch's float32 matmul setting (TF32 or not, `gemm.py`).

Forward only (no gradient wanted: `linear_logprob_forward_gemm`, which `linear_loss_grad` runs when
`needs` wants nothing): steps 1 and 2 alone, with or without the epilogue, in chunks of the
same rows.

Memory: one [C, V] float32 logits buffer per call, reused by every chunk (`chunk_rows`); d y
lives in it, each row over its own row of y (`dlogits_over`); (m, log s) [2, C] float32 pass
from step 2 to step 3 (8 bytes written and 8 read per row, where the lse alone took 4 read).
A float32 d W accumulator [V, D] only for a 16-bit weight over several chunks (a float32 d W
is its own accumulator; one chunk writes a 16-bit d W with one GEMM). A second backward
(`recompute_grads`) runs the same passes from the saved coefficients c, its statistics (m,
log s, logp) over the logits it recomputes.

No host synchronization: the code reads shapes, dtypes and its arguments, never a tensor's
values (no .item(), no data-dependent shapes); Triton and cuBLAS launches are asynchronous. A
target id outside [0, V) is clamped by the row kernels (memory safety; the caller reports it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import gemm
from .epilogue import EPILOGUE, EpilogueArgs
from .logits_logprobs import logits_logprob_backward, logits_logprob_forward
from .logits_loss_grad import logits_loss_grad

F32 = torch.float32
# The default budget of a call's chunk buffer on a GPU (`chunk_rows`): 704 MiB gives 1,344 rows
# at V = 128,256, D = 4,096, the chunks of the H200 rows in docs/gpu.md (1,328 rows, when the
# bf16 d logits had a buffer of their own beside the float32 logits and the budget was 1 GiB):
# the same GEMM shapes in two thirds of the memory. The fewer chunks of a larger budget save
# d W's float32 read-modify-write per chunk (a model estimate: ~1 ms each at the 8B head).
CUDA_BUDGET_BYTES = 704 * 2**20
# Chunks are a multiple of this many rows when they hold at least that many: every chunk's
# slices of the [N] per-token tensors then start 64-byte aligned, so every chunk launches the
# binary the first one compiled (Triton specializes pointers on 16-byte alignment).
ALIGN_ROWS = 16


class LossGrad(NamedTuple):
    """What `linear_loss_grad` returns (the fields of `chunked.loss_grad.LossGrad`)."""

    logp: torch.Tensor  # [Na] float32
    entropy: torch.Tensor  # [Na] float32, nats
    lse: torch.Tensor  # [Na] float32, of z = cap(s·y) / τ
    coef: torch.Tensor  # [Na] float32: weight·dℓ/dlogp, the epilogue's output
    d_hidden: torch.Tensor | None  # [Na, D] in hidden's dtype
    d_weight: torch.Tensor | None  # [V, D] in weight's dtype
    d_bias: torch.Tensor | None  # [V] in bias's dtype


def row_bytes(V: int, D: int) -> int:
    """The bytes one chunk row takes in `chunk_rows`' budget (its docstring says which)."""
    return V * 4 + D * 8


def chunk_rows(n: int, V: int, D: int, budget_bytes: int) -> int:
    """Rows per chunk for n rows: the largest count whose buffers fit `budget_bytes`, at least
    1 and at most n (1 for n = 0), a multiple of ALIGN_ROWS when at least ALIGN_ROWS and < n.

    Bytes per row: V·4 (float32 logits, with the d logits written over them: `dlogits_over`)
    + D·8 (at most two [rows, D] float32 temporaries: the mixed head's upcast hidden chunk and
    its d hidden before rounding, or the CPU emulation's partial sums)."""
    rows = int(budget_bytes) // row_bytes(V, D)
    if rows >= ALIGN_ROWS:
        rows -= rows % ALIGN_ROWS
    return max(1, min(rows, n))


def linear_loss_grad(hidden, weight, bias, targets, temperature, epilogue: EpilogueArgs,
                     g_ent=None, needs=(True, True, True), chunk_rows=None, budget_bytes=None,
                     softcap=None, logit_scale=None, fused_rows=False) -> LossGrad:
    """Loss terms and gradients of Σ weight·ℓ + Σ g_ent·H for z = cap(s·(h W^T + b)) / τ.

    hidden [Na, D] (contiguous; the rows to compute, masked tokens already dropped), weight
    [V, D], bias [V] | None, targets [Na] int64. epilogue: the GRPO epilogue's bundle
    (`epilogue.epilogue_args`) on these rows; the kernels fill its four [Na] outputs. g_ent:
    [Na] float32 entropy coefficients or None. needs: which of (hidden, weight, bias) want a
    gradient. chunk_rows: rows per chunk (default: `chunk_rows` of budget_bytes, default
    CUDA_BUDGET_BYTES). softcap, logit_scale: the logit transform. fused_rows: steps 2 and 3
    in one kernel (`logits_loss_grad.logits_loss_grad`; the same numbers, a candidate to race
    on a GPU: its second read of a row block may hit L2). Shapes are the caller's to
    guarantee; nothing here waits for the device."""
    _check(hidden, weight, bias, targets, epilogue, g_ent)
    if not _wants_grads(bias, needs):  # steps 1 and 2 only: no d y
        logp, ent, lse = linear_logprob_forward_gemm(
            hidden, weight, bias, targets, temperature, epilogue, chunk_rows=chunk_rows,
            budget_bytes=budget_bytes, softcap=softcap, logit_scale=logit_scale, check=False)
        return LossGrad(logp, ent, lse, epilogue.outputs[1], None, None, None)
    with torch.no_grad():  # the GEMMs write into buffers (out=): no autograd graph here
        return _loss_grad(hidden, weight, bias, targets, temperature, epilogue, g_ent, needs,
                          chunk_rows, budget_bytes, dict(softcap=softcap, logit_scale=logit_scale),
                          fused_rows)


def _loss_grad(hidden, weight, bias, targets, temperature, epilogue, g_ent, needs, rows_arg,
               budget_bytes, transform, fused: bool, coef=None) -> LossGrad:
    """The chunks' passes. epilogue None: the coefficients `coef` [Na] are given (a second
    backward, `recompute_grads`) and the row forward runs without the epilogue."""
    (Na, D), V = hidden.shape, weight.shape[0]
    dt = torch.promote_types(hidden.dtype, weight.dtype)  # the GEMMs' dtype (= weight's)
    C = _resolve_rows(rows_arg, budget_bytes, Na, V, D)
    f32 = dict(device=hidden.device, dtype=F32)
    logp, ent, lse = (torch.empty(Na, **f32) for _ in range(3))
    coef = epilogue.outputs[1] if epilogue is not None else coef
    grads = _Grads(hidden, weight, bias, needs, several=C < Na)
    logits = torch.empty(min(C, Na), V, **f32)  # [C, V], reused by every chunk
    split = torch.empty(2, min(C, Na), **f32)  # the row forward's (m, log s) of a chunk's rows
    dz = dlogits_over(logits, dt) if grads.wanted else None
    for r0 in range(0, Na, C):
        rows = slice(r0, min(r0 + C, Na))
        r = rows.stop - r0
        h = hidden[rows].to(dt)  # a copy only for the mixed head: [r, D] float32
        y = logits[:r]
        gemm.product(y, h, weight.T, bias)  # pass 1: raw logits [r, V] float32
        stats = (logp[rows], ent[rows], lse[rows])
        ep = None if epilogue is None else _chunk_epilogue(epilogue, rows)
        g_ent_rows = None if g_ent is None else g_ent[rows]
        d = None if dz is None else dz[:r]  # d loss / d y [r, V]
        if fused and d is not None:  # passes 2 and 3 in one kernel
            logits_loss_grad(y.view(r, 1, V), targets[rows], temperature, ep, g_ent_rows, stats,
                             d.view(r, 1, V), **transform)
        else:
            # p as the row forward formed it (m and log s), not through the lse
            m_logs = (split[0, :r], split[1, :r])
            logits_logprob_forward(y.view(r, 1, V), targets[rows], temperature, ep,
                                   **transform, out=stats, split_out=m_logs)
            if d is None:
                continue
            logits_logprob_backward(y.view(r, 1, V), targets[rows], stats[2], stats[1],
                                    coef[rows], g_ent_rows, temperature, out=d.view(r, 1, V),
                                    logp=stats[0], split=m_logs, **transform)
        if grads.dw is not None:  # padding's d y rows are 0; 0·h must add 0 where h is NaN
            live = coef[rows] != 0 if g_ent is None else (coef[rows] != 0) | (g_ent_rows != 0)
            h = torch.where(live[:, None], h, 0)  # [r, D]
        grads.add_chunk(rows, d, h, weight, first=r0 == 0)
    return LossGrad(logp, ent, lse, coef, *grads.finish())


def recompute_grads(hidden, weight, bias, targets, temperature, coef, g_ent=None,
                    needs=(True, True, True), chunk_rows=None, budget_bytes=None, softcap=None,
                    logit_scale=None) -> tuple:
    """(d hidden, d weight, d bias) of a `linear_loss_grad` call once more, from its coefficients
    coef = weight·dℓ/dlogp [Na] float32 (the epilogue's output; a second backward of a graph
    kept with retain_graph). The same passes without the epilogue: each chunk's row forward
    forms m and log s over the logits this call's GEMM gives, and its row backward reads p and
    the target column's 1 - p against them, so a row one token dominates gets p as these
    logits define it (the first call's statistics belong to logits that may round otherwise).
    Arguments as `linear_loss_grad`; None where `needs` wants no gradient."""
    _check(hidden, weight, bias, targets, None, g_ent)
    if coef.shape != targets.shape or coef.dtype != F32 or coef.device != hidden.device:
        raise ValueError(f"coef must be a [Na] = [{targets.shape[0]}] float32 tensor on "
                         f"{hidden.device}, got {tuple(coef.shape)} {coef.dtype} {coef.device}")
    if not _wants_grads(bias, needs):
        return None, None, None
    with torch.no_grad():
        out = _loss_grad(hidden, weight, bias, targets, temperature, None, g_ent, needs,
                         chunk_rows, budget_bytes, dict(softcap=softcap, logit_scale=logit_scale),
                         False, coef=coef.contiguous())
    return out.d_hidden, out.d_weight, out.d_bias


def linear_logprob_forward_gemm(hidden, weight, bias, targets, temperature, epilogue=None,
                                *, chunk_rows=None, budget_bytes=None, softcap=None,
                                logit_scale=None, check: bool = True) -> tuple:
    """Steps 1 and 2 alone, a forward that wants no gradient: per chunk of rows the library
    GEMM into the float32 [C, V] logits buffer, then the Triton row forward (with the GRPO
    epilogue when `epilogue` is given; it fills the epilogue's four [Na] outputs).

    hidden [Na, D] (contiguous), weight [V, D], bias [V] | None, targets [Na] int64 (contiguous)
    -> float32 (logp, entropy, lse), each [Na]. chunk_rows, budget_bytes, softcap, logit_scale:
    as `linear_loss_grad`. check: False when the caller
    (`linear_loss_grad`) has checked the arguments."""
    if check:
        _check(hidden, weight, bias, targets, epilogue, None)
    (Na, D), V = hidden.shape, weight.shape[0]
    dt = torch.promote_types(hidden.dtype, weight.dtype)  # the GEMM's dtype (= weight's)
    C = _resolve_rows(chunk_rows, budget_bytes, Na, V, D)
    f32 = dict(device=hidden.device, dtype=F32)
    logp, ent, lse = (torch.empty(Na, **f32) for _ in range(3))
    with torch.no_grad():  # the GEMMs write into a buffer (out=): no autograd graph here
        logits = torch.empty(min(C, Na), V, **f32)  # [C, V], reused by every chunk
        for r0 in range(0, Na, C):
            rows = slice(r0, min(r0 + C, Na))
            r = rows.stop - r0
            y = logits[:r]
            gemm.product(y, hidden[rows].to(dt), weight.T, bias)  # raw logits [r, V] float32
            ep = None if epilogue is None else _chunk_epilogue(epilogue, rows)
            logits_logprob_forward(y.view(r, 1, V), targets[rows], temperature, ep,
                                   softcap=softcap, logit_scale=logit_scale,
                                   out=(logp[rows], ent[rows], lse[rows]))
    return logp, ent, lse


def _wants_grads(bias, needs) -> bool:
    return bool(needs[0] or needs[1] or (bias is not None and needs[2]))


def dlogits_over(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The d logits [C, V] in `dtype` (float32 or 16-bit) over the float32 logits buffer [C, V]:
    the buffer itself for float32; else a view whose row n starts at row n's first byte and
    takes the first half of its bytes (row stride 2V). The row kernels read every element of a
    row before the write that lands on it (`logits_logprobs.shared_rows`), and the GEMMs take
    the strided rows as they are (a leading dimension of 2V), so the chunk needs no second
    buffer: 4 bytes per logit where a buffer of its own took 6."""
    if dtype == F32:
        return logits
    return logits.view(dtype)[:, :logits.shape[1]]


def _resolve_rows(rows, budget_bytes, Na, V, D) -> int:
    if rows is None:
        budget = CUDA_BUDGET_BYTES if budget_bytes is None else budget_bytes
        return chunk_rows(Na, V, D, budget)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"chunk_rows must be a positive int or None, got {rows!r}")
    return min(rows, max(Na, 1))


def _chunk_epilogue(ep: EpilogueArgs, rows: slice) -> EpilogueArgs:
    """The epilogue's bundle on rows `rows` of its [Na] tensors (views: outputs land in place)."""
    return EpilogueArgs(tuple(t[rows] for t in ep.tensors), ep.scalars, ep.flags)


class _Grads:
    """The gradients' buffers and the chunks' GEMMs into them. d hidden [Na, D] (hidden's
    dtype): each chunk writes its rows. d weight: summed over chunks in float32 (`acc`), which is
    d weight itself for a float32 weight; a 16-bit weight in one chunk gets one GEMM rounded
    once. d bias: float32 column sums of the d y chunks, cast at the end."""

    def __init__(self, hidden, weight, bias, needs, several: bool):
        (Na, D), V = hidden.shape, weight.shape[0]
        f32 = dict(device=hidden.device, dtype=F32)
        self.weight_dtype = weight.dtype
        self.bias_dtype = None if bias is None else bias.dtype
        self.dh = torch.empty_like(hidden) if needs[0] else None
        self.dw = None
        if needs[1]:
            self.dw = (torch.empty_like(weight) if weight.dtype == F32 or not several
                       else torch.empty(V, D, **f32))
            if Na == 0:
                self.dw.zero_()
        self.db = torch.zeros(V, **f32) if bias is not None and needs[2] else None

    @property
    def wanted(self) -> bool:
        return not (self.dh is None and self.dw is None and self.db is None)

    def add_chunk(self, rows: slice, d, h, weight, first: bool) -> None:
        """One chunk's products: d [r, V] (d y), h [r, D] hidden rows, both in the GEMM dtype."""
        if self.dh is not None:
            gemm.product(self.dh[rows], d, weight)  # complete for these rows: rounded once
        if self.dw is not None:
            gemm.product(self.dw, d.T, h, add=not first)  # the first chunk writes
        if self.db is not None:
            self.db += d.sum(dim=0, dtype=F32)

    def finish(self) -> tuple:
        dw = None if self.dw is None else self.dw.to(self.weight_dtype)  # no copy if float32
        db = None if self.db is None else self.db.to(self.bias_dtype)
        return self.dh, dw, db


def _check(hidden, weight, bias, targets, epilogue, g_ent) -> None:
    """Shapes, dtypes and devices (metadata only: nothing is read from the device)."""
    if hidden.dim() != 2 or not hidden.is_contiguous():
        raise ValueError(f"hidden must be a contiguous [Na, D] tensor, got shape "
                         f"{tuple(hidden.shape)} with strides {hidden.stride()}")
    Na, D = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != D or weight.stride(1) != 1:
        raise ValueError(f"weight must be [V, {D}] with contiguous rows, got shape "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    mixed = hidden.dtype in (torch.float16, torch.bfloat16) and weight.dtype == F32
    if hidden.dtype != weight.dtype and not mixed:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a "
                        "dtype, or be 16-bit with a float32 weight")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}] in weight's dtype "
                         f"{weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if targets.shape != (Na,) or targets.dtype != torch.int64 or not targets.is_contiguous():
        raise ValueError(f"targets must be a contiguous [Na] = [{Na}] int64 tensor, got "
                         f"{tuple(targets.shape)} {targets.dtype}")
    if epilogue is None:  # a forward without the epilogue (`linear_logprob_forward_gemm`)
        epi = ()
    elif not isinstance(epilogue, EpilogueArgs) or not EPILOGUE.value & epilogue.flags:
        raise ValueError("epilogue must be the GRPO epilogue's bundle (epilogue.epilogue_args)")
    else:
        epi = epilogue.tensors
    for name, t in [("epilogue tensor", t) for t in epi] + [("g_ent", g_ent)]:
        if t is not None and (t.shape != (Na,) or t.dtype != F32 or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [Na] = [{Na}] float32 tensor, got "
                             f"{tuple(t.shape)} {t.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("targets", targets), ("g_ent", g_ent),
                    *(("epilogue tensor", t) for t in epi)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")
