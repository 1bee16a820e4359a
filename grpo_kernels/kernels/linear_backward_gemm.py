"""Default backward of the linear-head log-prob: d logits per chunk, then GEMMs, no atomics.

Gradients of Σ g·logp + Σ g_H·H for z = (hidden [N, D] @ weight [V, D]^T + bias) / τ:
    d hidden = dz @ weight,   d weight = dz^T @ hidden,   d bias = Σ_n dz      (dz: d logits)
With a logit transform (`logit_transform.py`: z = cap(s·y) / τ, y the raw logits) dz is the
gradient w.r.t. y: the kernel multiplies each element by dz/dy = s·(1 - (cap/c)²) (s with a scale
only) before anything is stored; the GEMMs and d bias are unchanged.

dz [N, V] is never materialized whole. A Triton kernel (`_linear_dz_kernel`) recomputes the
logit tiles of one chunk and writes that chunk's dz, in the inputs' dtype for 16-bit inputs and
float32 otherwise, plus per-token-block column sums of the float32 dz for d bias. The chunk is
either a block of tokens [c, V] or a block of the vocabulary [N, c]:
  tokens: d hidden[rows] = dz @ weight is complete (one library GEMM, rounded once);
          d weight      += dz^T @ hidden[rows] is summed over the chunks.
  vocab:  d weight[cols] = dz^T @ hidden is complete (one library GEMM);
          d hidden      += dz @ weight[cols] is summed over the chunks.
The sum over chunks is float32 and is never rounded per chunk: `accumulate_mm` loads its float32
accumulator tile, adds the chunk's products and stores it (no atomics). The orientation whose
accumulator is smaller (min(N, V)·D floats, read and written once per chunk) is chosen; when only
one of the two gradients is needed, the orientation in which it is complete is chosen, and there
is no accumulator at all.

Every step is deterministic: no atomics, fixed chunk and reduction order, library GEMMs (cuBLAS
is deterministic run to run; PyTorch's deterministic mode asks for CUBLAS_WORKSPACE_CONFIG as it
does for any matmul), and d bias as a sum of per-block partials. The same inputs give bitwise the
same gradients.

Memory: the dz chunk (plus its d-bias partials) stays within `dz_budget_bytes`: 5% of the eager
float32 logits N·V·4 and at most 256 MiB (at least one tile row). With 16-bit inputs the float32
accumulator adds min(N, V)·D·4 bytes (the atomic backward holds the same for d hidden).

The cost model that makes this the default, and where the atomic backward
(`GRPO_KERNELS_LINEAR_BACKWARD=atomic`) can still win, is in benchmarks/NOTES.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tile_configs
from .accumulate_mm import accumulate_mm
from .dlogits import token_gradients, transformed_dz
from .linear_logprobs import grouped_program
from .logit_transform import grad_filter_scale, logit_transform_args
from .precision import dot_precision

# cap of the d-logits chunk (bf16: 256 MiB holds 883 tokens of a 152k vocabulary)
DZ_BUFFER_BYTES = 256 * 2**20
DZ_LOGITS_FRACTION = 0.05  # of the eager float32 logits N·V·4


@triton.jit(do_not_specialize=["n0", "n_count", "v0", "v_count", "n_blocks", "v_blocks",
                               "filter_eps"])
def _linear_dz_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr,
    dz_ptr,  # [n_count, v_count] (row stride stride_dz): d logits of the chunk
    dbp_ptr,  # [n_blocks, v_count] float32 (row stride stride_dbp): per token block,
              # the column sums of the float32 d logits (d bias partials)
    n0, n_count, v0, v_count, V, D, stride_hn, stride_wv, stride_dz, stride_dbp, inv_temp,
    n_blocks, v_blocks, filter_eps, logit_mul, softcap,
    HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr, FILTER: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # grouped order: GROUP_N token blocks sweep the chunk's vocabulary together (L2 reuse)
    pid_n, pid_v = grouped_program(tl.program_id(0), n_blocks, v_blocks, GROUP_N)
    local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # row of the chunk
    local_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column of the chunk
    n_mask = local_n < n_count
    v_mask = local_v < v_count
    offs_n = n0 + local_n  # token
    offs_v = v0 + local_v  # vocabulary row
    g, gh, scale = token_gradients(glogp_ptr, gent_ptr, offs_n, n_mask, HAS_GENT)
    # tokens without gradient (padding) read as absent: their d logits are 0 whatever their
    # hidden state holds (NaN·0 would be NaN); a NaN gradient still counts (NaN != 0)
    live = n_mask & (scale != 0.0)
    dz = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    # token blocks with no gradient (masked tokens) write zeros without the recompute (a sum,
    # so a NaN gradient still takes the recompute and flows into the result)
    if tl.sum(scale, axis=0) != 0.0:
        # d logits of the raw logits y; with a transform z = cap(s·y) the chain rule
        # d/dy = d/dz · s·(1 - (z/c)²) (or · s) is applied inside (`transformed_dz`)
        dz = transformed_dz(h_ptr, w_ptr, b_ptr, offs_n.to(tl.int64) * stride_hn,
                            offs_v.to(tl.int64) * stride_wv, offs_n, offs_v, live, v_mask, D,
                            g, gh, tgt_ptr, lse_ptr, ent_ptr, inv_temp, logit_mul, softcap,
                            HAS_BIAS, HAS_GENT, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PREC, HAS_SCALE,
                            HAS_SOFTCAP)
        if FILTER:
            # gradient filtering, as the atomic backward defines it: a tile whose |d logits|
            # are all <= filter_eps × its token's scale / τ contributes nothing
            thr = filter_eps * scale * inv_temp
            over = tl.where(tl.abs(dz) <= thr[:, None], 0, 1)  # NaN counts as over
            if tl.max(over) == 0:  # one flat reduction (below)
                dz = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    tl.store(dz_ptr + local_n.to(tl.int64)[:, None] * stride_dz + local_v[None, :],
             dz.to(dz_ptr.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])
    if COMPUTE_DB:  # d bias from the float32 d logits, before they are rounded for the GEMMs
        tl.store(dbp_ptr + pid_n.to(tl.int64) * stride_dbp + local_v, tl.sum(dz, axis=0),
                 mask=v_mask)


def dz_budget_bytes(N: int, V: int) -> int:
    """Bytes the d-logits chunk may take: 5% of eager float32 logits, at most 256 MiB."""
    return min(int(DZ_LOGITS_FRACTION * 4 * N * V), DZ_BUFFER_BYTES)


def chunk_sizes(N, V, block_n, block_v, elem_bytes, budget):
    """(rows, cols): the largest token chunk [rows, V] (rows a multiple of block_n) and vocabulary
    chunk [N, cols] (cols a multiple of block_v) of `elem_bytes` per element within `budget`
    bytes, at least one tile row and at most the whole problem."""
    elems = max(1, int(budget / elem_bytes))
    rows = min(max(block_n, elems // V // block_n * block_n), triton.cdiv(N, block_n) * block_n)
    cols = min(max(block_v, elems // N // block_v * block_v), triton.cdiv(V, block_v) * block_v)
    return rows, cols


def pick_orientation(N, V, D, rows, cols, need_dh, need_dw) -> str:
    """"tokens" or "vocab": the one that moves fewer float32 accumulator elements. By tokens,
    d weight [V, D] is read and written once per token chunk (if d weight is needed and there
    is more than one chunk); by vocabulary, d hidden [N, D] once per vocabulary chunk. Needing
    only one gradient thus picks the orientation in which it is complete (no accumulator)."""
    t_chunks, v_chunks = triton.cdiv(N, rows), triton.cdiv(V, cols)
    tokens_cost = V * D * t_chunks if need_dw and t_chunks > 1 else 0
    vocab_cost = N * D * v_chunks if need_dh and v_chunks > 1 else 0
    return "tokens" if tokens_cost <= vocab_cost else "vocab"


@torch.no_grad()  # library GEMMs with out=: under create_graph=True grad mode would be on here
def linear_logprob_backward_gemm(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    lse: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
    temperature: float, needs: tuple = (True, True, True), grad_filter: float | None = None,
    buffer_bytes: int | None = None, orientation: str | None = None, config: dict | None = None,
    softcap: float | None = None, logit_scale: float | None = None,
):
    """Gradients of Σ g_logp·logp + Σ g_ent·H w.r.t. hidden [N, D], weight [V, D], bias [V].

    Same contract as `linear_backward_atomic.linear_logprob_backward_atomic`: lse, ent, g_logp,
    g_ent are [N] float32; needs says which of (hidden, weight, bias) want a gradient; returns
    (d hidden, d weight, d bias) in the inputs' dtypes, None where not needed. grad_filter
    (None: exact) drops a [BLOCK_N, BLOCK_V] tile's d logits as the atomic backward does (same
    numbers, no work saved: the GEMMs stay dense). buffer_bytes (default `dz_budget_bytes`) and
    orientation ("tokens" / "vocab", default from `pick_orientation`) exist for tests.
    softcap, logit_scale: the forward's logit transform (`logit_transform_args`).
    """
    (N, D), V, dev = hidden.shape, weight.shape[0], hidden.device
    need_dh, need_dw, need_db = bool(needs[0]), bool(needs[1]), bias is not None and needs[2]
    # the GEMMs' dtype: the inputs' (16-bit dz, as the atomic kernel's dots take), float32 when
    # either input is float32 (a 16-bit hidden with a float32 head weight)
    common = torch.promote_types(hidden.dtype, weight.dtype)
    cfg = dict(config or tile_configs.linear_dz(common, dev, entropy_grad=g_ent is not None,
                                                softcap=softcap is not None))
    BN, BV = cfg["BLOCK_N"], cfg["BLOCK_V"]
    dh = torch.empty_like(hidden) if need_dh else None
    dw = torch.empty_like(weight) if need_dw else None
    db32 = torch.zeros(V, device=dev, dtype=torch.float32) if need_db else None
    if N == 0 or not (need_dh or need_dw or need_db):
        return (None if dh is None else dh.zero_(), None if dw is None else dw.zero_(),
                None if db32 is None else db32.to(bias.dtype))
    # per d-logits element: dz itself, plus the d-bias partials (one float per BLOCK_N rows)
    bytes_per = common.itemsize + (4 / BN if need_db else 0)
    rows, cols, by_tokens = _chunking(N, V, D, BN, BV, bytes_per, buffer_bytes, orientation,
                                      need_dh, need_dw)
    chunk = rows if by_tokens else cols
    dz = torch.empty((min(rows, N), V) if by_tokens else (N, min(cols, V)), device=dev,
                     dtype=common)
    dbp = torch.empty((triton.cdiv(dz.shape[0], BN), dz.shape[1]), device=dev,
                      dtype=torch.float32) if need_db else lse
    # with more than one chunk, one product is summed over the chunks in a float32
    # accumulator: the output itself when it is float32
    summed_out = dw if by_tokens else dh  # None when not needed
    acc = None
    if summed_out is not None and chunk < (N if by_tokens else V):
        acc = summed_out.zero_() if summed_out.dtype == torch.float32 else torch.zeros(
            summed_out.shape, device=dev, dtype=torch.float32)
    h_c, w_c = hidden.to(common), weight.to(common)  # no copy when the dtypes agree
    # d weight = dz^T·h: padding's dz rows are 0, and 0·h must add 0 where a padded hidden
    # state is NaN or ±inf, so d weight reads h with those rows zeroed: per token chunk (a
    # [rows, D] temporary), or once for all vocabulary chunks (an [N, D] copy)
    live = (g_logp != 0) if g_ent is None else (g_logp != 0) | (g_ent != 0)  # NaN != 0: live
    h_dw = h_c if by_tokens or not need_dw else torch.where(live[:, None], h_c, 0)
    for start in range(0, N if by_tokens else V, chunk):
        n0, nc, v0, vc = (start, min(chunk, N - start), 0, V) if by_tokens else (
            0, N, start, min(chunk, V - start))
        n_blocks, v_blocks = triton.cdiv(nc, BN), triton.cdiv(vc, BV)
        d = dz[:nc, :vc]
        _linear_dz_kernel[(n_blocks * v_blocks,)](
            hidden, weight, bias if bias is not None else hidden, targets, lse, ent, g_logp,
            g_ent if g_ent is not None else g_logp, d, dbp,
            n0, nc, v0, vc, V, D, hidden.stride(0), weight.stride(0), dz.stride(0),
            dbp.stride(0),
            1.0 / temperature, n_blocks, v_blocks,
            0.0 if grad_filter is None else float(grad_filter) * grad_filter_scale(logit_scale),
            HAS_BIAS=bias is not None, HAS_GENT=g_ent is not None,
            FILTER=grad_filter is not None, COMPUTE_DB=need_db,
            DOT_PREC=dot_precision(hidden.dtype), **cfg,
            **logit_transform_args(softcap, logit_scale),
        )
        _add_chunk_products(d, slice(n0, n0 + nc), slice(v0, v0 + vc), h_dw, w_c,
                            (dh, dw, db32), acc, dbp[:n_blocks], by_tokens, live)
    if acc is not None and summed_out.data_ptr() != acc.data_ptr():
        summed_out.copy_(acc)
    return dh, dw, None if db32 is None else db32.to(bias.dtype)


def _chunking(N: int, V: int, D: int, BN: int, BV: int, bytes_per: float,
              buffer_bytes: int | None, orientation: str | None, need_dh: bool, need_dw: bool
              ) -> tuple[int, int, bool]:
    """(rows, cols, by_tokens): the d-logits chunk under the buffer budget and its orientation
    (`pick_orientation` unless given)."""
    budget = dz_budget_bytes(N, V) if buffer_bytes is None else buffer_bytes
    rows, cols = chunk_sizes(N, V, BN, BV, bytes_per, budget)
    if orientation is None:
        orientation = pick_orientation(N, V, D, rows, cols, need_dh, need_dw)
    elif orientation not in ("tokens", "vocab"):
        raise ValueError(f"orientation must be 'tokens' or 'vocab', got {orientation!r}")
    return rows, cols, orientation == "tokens"


def _add_chunk_products(d, rows: slice, cols: slice, h_c, w_c, grads, acc, dbp,
                        by_tokens: bool, live) -> None:
    """The GEMMs of one chunk's d logits d [rows, cols] (hidden rows × vocabulary columns): the
    gradient that is complete within the chunk is written once (one rounding); the other is
    summed over the chunks (`acc`, float32; or written when there is one chunk). grads:
    (d hidden, d weight, d bias float32), None where not needed; dbp: the chunk's d-bias
    partials [n_blocks, cols], one row per BLOCK_N tokens; live [N]: the tokens with a gradient
    (by tokens, d weight reads the chunk's hidden rows with the others zeroed)."""
    dh, dw, db32 = grads
    if by_tokens:
        if dh is not None:  # complete for these rows: one GEMM, rounded once
            _mm_into(dh[rows], d, w_c)
        if dw is not None:
            _sum_or_mm(acc, dw, d.T, torch.where(live[rows, None], h_c[rows], 0))
        if db32 is not None:
            db32 += dbp.sum(0)
    else:
        if dw is not None:
            _mm_into(dw[cols], d.T, h_c)
        if dh is not None:
            _sum_or_mm(acc, dh, d, w_c[cols])
        if db32 is not None:
            db32[cols] = dbp[:, :d.shape[1]].sum(0)


def _sum_or_mm(acc, out, a, b) -> None:
    """acc += a @ b (float32, over the chunks) or, with one chunk (acc None), out = a @ b."""
    if acc is None:
        _mm_into(out, a, b)
    else:
        accumulate_mm(acc, a, b)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b with a library GEMM (float32 accumulation inside), rounded once to out's
    dtype; a copy only when out's dtype differs from the GEMM's (a mixed-precision head)."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))
