"""Triton kernels: selective log-prob (and entropy) from logits that the caller already holds.

    z = cap(s·logits) / τ  [N, V] (any float dtype, read as float32; cap(s·x) = x unless a soft
                                   cap or logit scale is given, see `logit_transform.py`)
    lse = logsumexp(z), logp = z[target] - lse, H = lse - Σ softmax(z)·z

Memory-bound: forward reads each row once (online log-sum-exp, target pick, entropy, optional
GRPO epilogue); backward reads it once more and writes d logits once, into a fresh buffer or, with
`inplace`, over the logits themselves. Nothing of [N, V] float32 is ever allocated.
The backward reads p = e^(z - lse), or, given the forward's two terms of the lse (`split_out`:
the row max m and log s, s = Σ e^(z - m)), p = e^((z - m) - log s) as the forward formed it: at
a row one token dominates, 1/s to float32's precision, where the lse's rounding at its
magnitude (2e-6 at |lse| ≈ 40) would show. `logits_loss_grad.py` runs both in one program per
row block. Layout: forward kernel, launcher; backward kernel, launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tile_configs
from .epilogue import EPILOGUE, load_token_weights, no_epilogue, skipped_token_outputs
from .linear_logprobs import NEG_BIG, _store_token_results, loop_bound
from .logit_transform import logit_transform_args, softcap_logits, softcap_logits_grad


@triton.jit
def _row_offsets(offs_n, T, stride_b, stride_t):
    # row n of the flattened [B, T] lives at b·stride_b + t·stride_t: views sliced out of a
    # model's [B, L, V] logits are read in place
    offs = offs_n.to(tl.int64)
    return (offs // T) * stride_b + (offs % T) * stride_t


@triton.jit
def _clamped_targets(tgt_ptr, offs_n, n_mask, V):
    """The rows' target ids [ROWS] int64, clamped to [0, V): memory-safe with any id."""
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=0)
    return tl.minimum(tl.maximum(tgt, 0), V - 1)


@triton.jit
def _nonzero_rows(x):
    """How many of a block's [ROWS] values are not 0, NaN included (NaN != 0): whether a block
    has a gradient (or a weight). A max of |x| would drop a NaN beside zeros (a reduction's
    maximum ignores NaN), skip a broken row's block and give it zeros where it is NaN."""
    return tl.sum(tl.where(x != 0.0, 1.0, 0.0), axis=0)


@triton.jit
def _row_statistics(x_ptr, rows, n_mask, V, inv_temp, logit_mul, softcap, ROWS: tl.constexpr,
                    BLOCK_V: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(lse, entropy, m, log s) [ROWS] of z = cap(s·x) / τ, rows at offsets `rows`, one online
    sweep over V (max m, s = Σ e^(z - m), Σ e^(z - m)·(z - m)); logp = (z_target - m) - log s."""
    m = tl.full([ROWS], NEG_BIG, tl.float32)  # running max
    s = tl.zeros([ROWS], tl.float32)  # Σ e^(z - m)
    t = tl.zeros([ROWS], tl.float32)  # Σ e^(z - m)·(z - m)
    for v0 in range(0, loop_bound(V), BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        msk = n_mask[:, None] & (offs_v[None, :] < V)
        x = tl.load(x_ptr + rows[:, None] + offs_v[None, :], mask=msk,
                    other=float("-inf")).to(tl.float32)
        if HAS_SCALE or HAS_SOFTCAP:
            # a masked -inf does not stay -inf through the transform (the cap makes it ±c, a
            # negative scale +inf): the mask is applied after it
            z = tl.where(msk, softcap_logits(x, logit_mul, softcap, HAS_SCALE, HAS_SOFTCAP)
                         * inv_temp, float("-inf"))
        else:
            z = x * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])
        zc = tl.where(msk, z - m_new[:, None], 0.0)
        t = alpha * (t + (m - m_new) * s) + tl.sum(p * zc, axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new
    log_s = tl.log(tl.where(n_mask, s, 1.0))
    return m + log_s, log_s - t / tl.where(n_mask, s, 1.0), m, log_s


@triton.jit
def _forward_rows(x_ptr, tgt_ptr, lse_ptr, ent_ptr, logp_ptr, max_ptr, logs_ptr, epi_tensors,
                  epi_scalars, N, V, T, stride_xb, stride_xt, inv_temp, logit_mul, softcap,
                  EPI_FLAGS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                  HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  SKIP_ZERO_WEIGHT: tl.constexpr, SPLIT_LSE: tl.constexpr):
    """The forward of this program's ROWS tokens: log-sum-exp, entropy and log-prob stored (with
    SPLIT_LSE also the lse's terms m and log s), the epilogue run; returns (offs_n, n_mask, rows,
    m, log_s, ent, logp, g) for a backward sweep to follow.

    SKIP_ZERO_WEIGHT (with the epilogue): a block whose rows all have weight 0 (padding) reads
    no logits and runs no epilogue (`epilogue.skipped_token_outputs`: log-prob, entropy,
    weight·ℓ, its coefficient and kl 0, the ratio 1, as the three-pass route fills the rows it
    does not compute), and its lse is NaN, the mark by which the backward recomputes a row that
    turns out to have a gradient after all (`logits_logprob_backward(skipped_rows=True)`)."""
    offs_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_mask = offs_n < N
    rows = _row_offsets(offs_n, T, stride_xb, stride_xt)
    live = True
    if SKIP_ZERO_WEIGHT:
        live = _nonzero_rows(load_token_weights(offs_n, n_mask, epi_tensors)) != 0.0
    m = tl.zeros([ROWS], tl.float32)
    log_s = tl.zeros([ROWS], tl.float32)
    ent = tl.zeros([ROWS], tl.float32)
    logp = tl.zeros([ROWS], tl.float32)
    g = tl.zeros([ROWS], tl.float32)
    if live:
        # a target id outside [0, V) (the caller reports it; nothing here can) is clamped into
        # the row, so that no load leaves the logits; the backward clamps it the same way
        tgt = _clamped_targets(tgt_ptr, offs_n, n_mask, V)
        lse, ent, m, log_s = _row_statistics(x_ptr, rows, n_mask, V, inv_temp, logit_mul,
                                             softcap, ROWS, BLOCK_V, HAS_SCALE, HAS_SOFTCAP)
        # the target logit: one load after the sweep (across it: 8 B spilled, Triton 3.4, sm_80)
        x_tgt = tl.load(x_ptr + rows + tgt, mask=n_mask, other=0.0).to(tl.float32)
        z_tgt = softcap_logits(x_tgt, logit_mul, softcap, HAS_SCALE, HAS_SOFTCAP) * inv_temp
        logp = (z_tgt - m) - log_s
        g = _store_token_results(offs_n, n_mask, lse, ent, logp, lse_ptr, ent_ptr, logp_ptr,
                                 epi_tensors, epi_scalars, EPI_FLAGS)
        if SPLIT_LSE:  # a skipped row's m stays the NaN the launcher wrote (its mark)
            tl.store(max_ptr + offs_n, m, mask=n_mask)
            tl.store(logs_ptr + offs_n, log_s, mask=n_mask)
    else:  # no epilogue either: its inputs at padding may be anything (an old log-prob of -100
        # would overflow the ratio of a log-prob 0, and 0·inf is NaN)
        skipped_token_outputs(offs_n, n_mask, lse_ptr, ent_ptr, logp_ptr, epi_tensors)
    return offs_n, n_mask, rows, m, log_s, ent, logp, g


@triton.jit(do_not_specialize=["N", "T"])
def _logits_logprob_fwd_kernel(
    x_ptr, tgt_ptr, lse_ptr, ent_ptr, logp_ptr, max_ptr, logs_ptr,  # m, log s: with SPLIT_LSE
    epi_tensors, epi_scalars,  # the GRPO epilogue's bundle (epilogue.py), read with EPI_FLAGS
    N, V, T, stride_xb, stride_xt, inv_temp, logit_mul, softcap,
    EPI_FLAGS: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SKIP_ZERO_WEIGHT: tl.constexpr,
    SPLIT_LSE: tl.constexpr,
):
    _forward_rows(x_ptr, tgt_ptr, lse_ptr, ent_ptr, logp_ptr, max_ptr, logs_ptr, epi_tensors,
                  epi_scalars, N, V, T, stride_xb, stride_xt, inv_temp, logit_mul, softcap,
                  EPI_FLAGS, ROWS, BLOCK_V, HAS_SCALE, HAS_SOFTCAP, SKIP_ZERO_WEIGHT, SPLIT_LSE)


def logits_logprob_forward(logits, targets, temperature, epilogue=None, softcap=None,
                           logit_scale=None, out=None, skip_zero_weight=False, split_out=None):
    """logits [B, T, V] (last dim contiguous), targets [B·T] int64
    -> float32 (logp, entropy, lse), each [B·T]. softcap / logit_scale: the logits given are
    raw, and z = cap(s·logits) / τ (`logit_transform.py`). out: three [B·T] float32 tensors
    (contiguous) to write (logp, entropy, lse) into instead of fresh ones. split_out: None or
    two [B·T] float32 tensors to write the lse's terms into, the row max m of z and log s,
    s = Σ e^(z - m) (lse = m + log s), for `logits_logprob_backward(split=...)`.
    skip_zero_weight (with an epilogue): rows of weight 0 are not computed where a whole row
    block has weight 0 (one row per block at V >= 4096): logp and entropy 0 there, lse NaN, and
    with split_out m NaN, log s unwritten (`_forward_rows`); `logits_logprob_backward`
    recomputes such a row if it has a gradient."""
    if skip_zero_weight and (epilogue is None or not EPILOGUE.value & epilogue.flags):
        raise ValueError("skip_zero_weight needs the GRPO epilogue, whose weights say which "
                         "rows to skip")
    B, T, V = logits.shape
    N = B * T
    f32 = dict(device=logits.device, dtype=torch.float32)
    logp, ent, lse = out if out is not None else (torch.empty(N, **f32) for _ in range(3))
    if N == 0:
        return logp, ent, lse
    # skipping with a soft cap: the backward's narrower blocks (8 B spilled at 4096, sm_90,
    # Triton 3.4, V = 32,001)
    cfg = tile_configs.logits(V, logits.device,
                              softcap_backward=skip_zero_weight and softcap is not None)
    ep = epilogue or no_epilogue(logp)
    m, log_s = (lse, lse) if split_out is None else split_out
    if skip_zero_weight and split_out is not None:
        m.fill_(float("nan"))  # a skipped row's mark, as its lse's (the kernel writes live rows)
    _logits_logprob_fwd_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
        logits, targets, lse, ent, logp, m, log_s, ep.tensors, ep.scalars,
        N, V, T, logits.stride(0), logits.stride(1), 1.0 / temperature,
        EPI_FLAGS=ep.flags, SKIP_ZERO_WEIGHT=skip_zero_weight,
        SPLIT_LSE=split_out is not None, **cfg,
        **logit_transform_args(softcap, logit_scale),
    )
    return logp, ent, lse


@triton.jit
def _expm1(x):
    """e^x - 1 [ROWS]: the series to x³ for |x| < 1e-3 (no cancellation), e^x - 1 beyond."""
    return tl.where(tl.abs(x) < 1e-3, x * (1.0 + x * (0.5 + x * (1.0 / 6.0))), tl.exp(x) - 1.0)


@triton.jit
def _d_logits_sweep(x_ptr, dx_ptr, rows, drows, n_mask, tgt, shift, log_s, ent, logp, g, gh,
                    busy, V, inv_temp, logit_mul, softcap, HAS_GENT: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SCALE: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, ALIASED: tl.constexpr):
    """Writes the d logits of a block of rows (offsets `rows` in x, `drows` in dx) in one sweep
    over V; tgt, shift, log_s, ent, logp (the forward's), g = g_logp, gh = g_entropy are [ROWS];
    busy == 0 (no row of the block has a gradient) writes zeros without reading x. log p is
    (z - shift) - log_s: shift = lse and log_s = 0, or the forward's m and log s (p as the
    forward formed it). At the target column log p is logp unless NaN, 1 - p is -expm1(logp).

    ALIASED: dx is narrower than x and written over it (`shared_rows`): element j of a row's
    d logits lands on x element j·isize(dx)/isize(x) <= j of the same row, which this sweep, or
    an earlier one, has read. Another thread of the program may hold that element, so a barrier
    before each store orders every thread's reads (and the forward's, in the fused kernel)
    before any write. Loads run ahead of it only into later columns, which no write reaches."""
    live = (g != 0.0) | (gh != 0.0)  # rows with a gradient (NaN counts); gh is g without H
    for v0 in range(0, loop_bound(V), BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        msk = n_mask[:, None] & (offs_v[None, :] < V)
        if busy != 0.0:
            x = tl.load(x_ptr + rows[:, None] + offs_v[None, :], mask=msk,
                        other=0.0).to(tl.float32)
            dzdx = 1.0
            if HAS_SCALE or HAS_SOFTCAP:
                x, dzdx = softcap_logits_grad(x, logit_mul, softcap, HAS_SCALE, HAS_SOFTCAP)
            at_t = (offs_v[None, :] == tgt[:, None]) & (logp == logp)[:, None]
            log_p = tl.where(at_t, logp[:, None],
                             (x * inv_temp - shift[:, None]) - log_s[:, None])
            p = tl.exp(log_p)
            onehot = tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
            dz = g[:, None] * tl.where(at_t, -_expm1(logp)[:, None], onehot - p)
            if HAS_GENT:
                dz -= gh[:, None] * p * (log_p + ent[:, None])
            dz = dz * inv_temp
            if HAS_SCALE or HAS_SOFTCAP:
                dz = dz * dzdx
            dz = tl.where(live[:, None], dz, 0.0)  # padding: 0 whatever x holds (0·NaN = NaN)
        else:
            dz = tl.zeros([ROWS, BLOCK_V], tl.float32)  # rows without gradient: no read
        if ALIASED:
            tl.debug_barrier()
        tl.store(dx_ptr + drows[:, None] + offs_v[None, :],
                 dz.to(dx_ptr.dtype.element_ty), mask=msk)


@triton.jit(do_not_specialize=["N", "T"])
def _logits_logprob_bwd_kernel(
    x_ptr, dx_ptr, tgt_ptr, shift_ptr, logs_ptr, ent_ptr, glogp_ptr, gent_ptr,
    logp_ptr,  # the forward's logp; shift: the lse, or with SPLIT_LSE m beside log s (logs_ptr)
    N, V, T, stride_xb, stride_xt, stride_db, stride_dt, inv_temp, logit_mul, softcap,
    HAS_GENT: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ALIASED: tl.constexpr,
    SPLIT_LSE: tl.constexpr,
):
    # d logits_j = [g·(onehot_j - p_j) - g_H·p_j·(log p_j + H)] / τ  (see linear_logprobs.py);
    # with a transform z = cap(s·x) of the logits x given: d x_j = d logits_j · dz_j/dx_j,
    # dz/dx = s·(1 - (z/c)²) with a cap, s without (`softcap_logits_grad`)
    offs_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_mask = offs_n < N
    rows = _row_offsets(offs_n, T, stride_xb, stride_xt)
    drows = _row_offsets(offs_n, T, stride_db, stride_dt)
    g = tl.load(glogp_ptr + offs_n, mask=n_mask, other=0.0)
    busy = _nonzero_rows(g)
    gh = g
    ent = g
    if HAS_GENT:
        gh = tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0)
        ent = tl.load(ent_ptr + offs_n, mask=n_mask, other=0.0)
        busy += _nonzero_rows(gh)
    # the target column as given: an id outside [0, V) (another vocabulary shard's, see
    # grpo_kernels/parallel; or a bad id, which the caller reports) matches no column and adds
    # no one-hot term, as in the linear head's tile kernels (`dlogits.dz_tile`)
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=-1)
    shift = tl.load(shift_ptr + offs_n, mask=n_mask, other=0.0)
    log_s = tl.zeros([ROWS], tl.float32)
    if SPLIT_LSE:
        log_s = tl.load(logs_ptr + offs_n, mask=n_mask, other=0.0)
    logp = tl.load(logp_ptr + offs_n, mask=n_mask, other=0.0)  # NaN: not given
    _d_logits_sweep(x_ptr, dx_ptr, rows, drows, n_mask, tgt, shift, log_s, ent, logp, g, gh,
                    busy, V, inv_temp, logit_mul, softcap, HAS_GENT, ROWS, BLOCK_V, HAS_SCALE,
                    HAS_SOFTCAP, ALIASED)


@triton.jit(do_not_specialize=["N", "T"])
def _skipped_rows_kernel(
    x_ptr, lse_ptr, ent_ptr, lse_out_ptr, ent_out_ptr, glogp_ptr, gent_ptr,
    N, V, T, stride_xb, stride_xt, inv_temp, logit_mul, softcap,
    HAS_GENT: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # lse and entropy copied; a row the forward skipped (lse NaN, `_forward_rows`) in a block
    # that has a gradient gets its statistics now: its own gradient needs them, and so does a
    # row of g = 0 beside it (0·p must stay 0, and p of a NaN lse is NaN)
    offs_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_mask = offs_n < N
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    ent = tl.load(ent_ptr + offs_n, mask=n_mask, other=0.0)
    busy = _nonzero_rows(tl.load(glogp_ptr + offs_n, mask=n_mask, other=0.0))
    if HAS_GENT:
        busy += _nonzero_rows(tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0))
    stale = lse != lse
    if (busy != 0.0) & (tl.max(stale.to(tl.int32), axis=0) != 0):
        rows = _row_offsets(offs_n, T, stride_xb, stride_xt)
        lse_now, ent_now, _, _ = _row_statistics(x_ptr, rows, n_mask, V, inv_temp, logit_mul,
                                                 softcap, ROWS, BLOCK_V, HAS_SCALE, HAS_SOFTCAP)
        lse = tl.where(stale, lse_now, lse)
        ent = tl.where(stale, ent_now, ent)
    tl.store(lse_out_ptr + offs_n, lse, mask=n_mask)
    tl.store(ent_out_ptr + offs_n, ent, mask=n_mask)


def _with_skipped_rows(logits, lse, ent, g_logp, g_ent, temperature, softcap, logit_scale):
    """(lse, entropy) [B·T] for the backward: copies of the forward's, with the rows it
    skipped recomputed where their block has a gradient (`_skipped_rows_kernel`). The saved
    tensors stay as they were, for a second backward."""
    B, T, V = logits.shape
    N = B * T
    lse_out, ent_out = torch.empty_like(lse), torch.empty_like(ent)
    # a soft cap takes the backward's narrower blocks (8 B spilled at 4096 on sm_90, Triton 3.4)
    cfg = tile_configs.logits(V, logits.device, softcap_backward=softcap is not None)
    _skipped_rows_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
        logits, lse, ent, lse_out, ent_out, g_logp, g_ent if g_ent is not None else g_logp,
        N, V, T, logits.stride(0), logits.stride(1), 1.0 / temperature,
        HAS_GENT=g_ent is not None, **cfg, **logit_transform_args(softcap, logit_scale))
    return lse_out, ent_out


def logits_logprob_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, out=None,
                            softcap=None, logit_scale=None, skipped_rows=False, logp=None,
                            split=None):
    """d logits [B, T, V] for Σ g_logp·logp + Σ g_ent·H, in logits' dtype or `out`'s; written
    into `out`, which may be `logits` itself (each element is read before it is overwritten) or
    a narrower view over its rows (`shared_rows`). softcap / logit_scale: as in
    `logits_logprob_forward` (d of the raw logits). skipped_rows: lse may mark rows the forward
    skipped (NaN, `logits_logprob_forward(skip_zero_weight=True)`); they are recomputed first
    where they need to be (`_with_skipped_rows`). logp: None or the forward's log-probs [B·T],
    the target column's (else, and at a skipped row, z/τ - lse: `_d_logits_sweep`). split: None
    or the forward's (m, log s) [B·T] each (`logits_logprob_forward(split_out=...)`): every
    other column's p is read against them, not through the lse; with skipped_rows a NaN m marks
    a skipped row, whose recomputed lse then stands for m and 0 for log s."""
    B, T, V = logits.shape
    N = B * T
    dx = torch.empty_like(logits) if out is None else out
    aliased = shared_rows(logits, dx) and dx.element_size() != logits.element_size()
    if N == 0:
        return dx
    shift, log_s = (lse, lse) if split is None else split  # shift: the lse, or m
    # NaN where there is no log-prob: none given, or a skipped row's (0; its shift is NaN)
    logp = torch.full_like(lse, float("nan")) if logp is None else (
        torch.where(torch.isnan(shift), shift, logp) if skipped_rows else logp)
    if skipped_rows:
        stale = torch.isnan(shift)
        shift, ent = _with_skipped_rows(logits, shift, ent, g_logp, g_ent, temperature,
                                        softcap, logit_scale)
        log_s = shift if split is None else torch.where(stale, 0.0, log_s)
    cfg = tile_configs.logits(V, logits.device, softcap_backward=softcap is not None,
                              converting_backward=dx.dtype != logits.dtype)
    _logits_logprob_bwd_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
        logits, dx, targets, shift, log_s, ent, g_logp, g_ent if g_ent is not None else g_logp,
        logp, N, V, T, logits.stride(0), logits.stride(1), dx.stride(0), dx.stride(1),
        1.0 / temperature, HAS_GENT=g_ent is not None, ALIASED=aliased,
        SPLIT_LSE=split is not None, **cfg,
        **logit_transform_args(softcap, logit_scale),
    )
    return dx


def shared_rows(logits: torch.Tensor, dx: torch.Tensor) -> bool:
    """Does dx [B, T, V] write over the logits [B, T, V]? Either not at all (False), or as the
    kernels support it (True): dx is the logits themselves, or a view in a narrower dtype whose
    rows start at the logits' rows' bytes (a 16-bit d y over float32 logits, each of its rows in
    the first half of the logits row's bytes: `linear_loss_grad.dlogits_over`). Any other
    overlap would let a write land on logits not yet read: a ValueError."""
    if dx.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
        return False
    same_bytes = all(dx.stride(i) * dx.element_size() == logits.stride(i) * logits.element_size()
                     for i in range(2) if logits.shape[i] > 1)
    if (dx.shape != logits.shape or dx.data_ptr() != logits.data_ptr() or not same_bytes
            or dx.element_size() > logits.element_size() or dx.stride(2) != 1):
        raise ValueError(
            f"the d logits share the logits' memory but not their rows: d logits {dx.dtype} "
            f"{tuple(dx.shape)} strides {dx.stride()} at {dx.data_ptr()}, logits {logits.dtype} "
            f"{tuple(logits.shape)} strides {logits.stride()} at {logits.data_ptr()}; they "
            "must be the logits themselves or a view, no wider, whose rows start at theirs")
    return True
