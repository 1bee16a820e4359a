"""The linear head's loss gradient inside the forward: three matrix products instead of four.

For a loss of per-token terms

    L = Σ_n f_n(logp_n) + Σ_n g_H,n·H_n

where f_n reads token n's own log-prob only (the token-level GRPO losses: f_n = weight·ℓ) and
g_H is a fixed per-token entropy coefficient (the entropy bonus), each row of d L / d logits
depends on that row's logits and on nothing else of the batch. So once a chunk of rows holds its
logits over the whole vocabulary, its log-sum-exp, log-probs and entropies are known, the
caller's `d_logp` gives c_n = f_n'(logp_n), and the chunk's d logits goes straight into the two
gradient GEMMs:

    pass 1  z = h @ W^T (+ b), the chunk's logits [C, V]
    pass 2  d hidden[chunk] = d y @ W                [C, D]
    pass 3  d W += d y^T @ h[chunk]                   [V, D]   (d b += Σ_rows d y)

against four for the forward + backward of `linear_launchers.py` (the backward recomputes the
logits).
d y is the backward's (`tiles.neg_dz_tile`, `tiles.general_mode`): with z in nats, p = softmax(z),
y the raw logits and z = y / τ,

    d y = -x / τ,   x = p·(c + g_H·(ln p + H)) - c·onehot

(the log-prob's part of it is d logp / dz = onehot - p, the entropy's d H / dz = -p·(ln p + H)).
Without an entropy coefficient x = (c/s)·(e - s·onehot), e = 2^(z - m) the chunk's exponentials
and s = Σ e, so the per-token factor c/s rides on the [C, D] sides of the GEMMs (onto d hidden
after its GEMM, onto h before d W's) and the tile itself only gets the target's -s: no pass over
the tile beyond those the statistics need.

Chunks hold whole rows ([C, V], two such buffers: the logits and their exponentials) within a
memory budget in bytes (`chunk_rows`; `CPU_BUDGET_BYTES` by default): as many rows as the budget
gives, or none where three passes would not pay (fewer than MIN_ROWS rows per chunk while more
tokens remain) or cannot fit; the caller then keeps the four-pass path. Only the rows the caller
lists (`rows`: tokens with a non-zero mask) are computed.

A weight narrower than the compute dtype (a bfloat16/float16 head, float32 logits) is never
copied whole to float32 unless the budget holds that copy beside the chunk's rows: otherwise each
chunk's two weight GEMMs (logits, d hidden) convert vocabulary slices of SLICE_BYTES into one
reused buffer. Its d W accumulates over chunks in the compute dtype ([V, D], counted in the
budget: no such head takes this path when the budget cannot hold it) and is returned in the
weight's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .blocks import pick_rows, row_parts
from .tiles import (
    LN2,
    compute_dtype,
    empty_stats,
    finish_stats,
    head_transform,
    log2_head,
    logits_tile,
    tile_buffer,
    view,
    weight_tile,
)

# The chunk budget on the CPU: two [rows, V] float32 buffers of 220 rows at V = 151,936
# (Qwen2.5), 261 at V = 128,256 (Llama 3). Measured at those heads (CPU time of forward +
# backward, docs/benchmarks.md): 128 rows took 13-18 % longer than 256, 512 rows 5-7 % less at
# twice the memory.
CPU_BUDGET_BYTES = 256 * 2**20
# Fewest rows per chunk at which three passes still beat the four-pass route when the tokens
# need several chunks. Measured (same runs): 96 rows took 0.74 (Qwen2.5-0.5B head) and 0.86
# (Llama-3.2-1B) of the four-pass route's time, 64 rows 0.84 and 0.93, 32 rows 1.12 and 1.20.
MIN_ROWS = 96
# A weight slice converted to the compute dtype for the chunk's GEMMs (a 16-bit head without
# room for one whole copy): 32 MiB, 9,362 rows of D = 896 in float32.
SLICE_BYTES = 32 * 2**20


class LossGrad(NamedTuple):
    """What `linear_loss_grad` returns. Per-token values cover the Na rows computed, in the
    order of `rows`, float32; gradients are in their inputs' dtypes (None where not wanted)."""

    logp: torch.Tensor  # [Na]
    entropy: torch.Tensor  # [Na], nats
    lse: torch.Tensor  # [Na], nats, of z = y / τ
    coef: torch.Tensor  # [Na]: c = d L / d logp, as `d_logp` gave it
    d_hidden: torch.Tensor | None  # [N, D], zero on rows not computed
    d_weight: torch.Tensor | None  # [V, D]
    d_bias: torch.Tensor | None  # [V]


def chunk_rows(n: int, V: int, D: int, weight_dtype: torch.dtype, budget_bytes: int, *,
               dtype: torch.dtype | None = None, want_dw: bool = True) -> tuple[int | None, str]:
    """(rows of one [rows, V] chunk for n tokens, a short phrase saying why), or (None, why not).

    The chunk's bytes: two [rows, V] buffers of the compute dtype `dtype` (float32, or float64
    for a float64 weight by default), 8·V bytes a row in float32. A weight of another dtype (a
    16-bit head) adds its compute-dtype d W accumulator [V, D] when `want_dw`, and either one
    [V, D] copy (when the budget holds it beside the rows it would hold without it) or a slice
    buffer of SLICE_BYTES. The rows are min(n, what the rest of the budget holds), at least 1.

    The rule: None when the budget holds no row (or not the accumulator), or holds fewer than
    MIN_ROWS rows while n needs more chunks than one: below that, every chunk streams the weight
    twice and reads and writes d W once for too few rows, and the four-pass route (which reads
    the weight once per pass for all tokens) is faster (measured: docs/benchmarks.md). One
    chunk of all n rows always pays (three products against four)."""
    plan = _plan(n, V, D, weight_dtype, budget_bytes, dtype, want_dw)
    return plan.rows, plan.reason


class _Plan(NamedTuple):
    rows: int | None  # None: not this path
    cols: int  # vocabulary rows per compute-dtype slice of the weight (V: one slice)
    reason: str


def _plan(n, V, D, weight_dtype, budget_bytes, dtype, want_dw) -> _Plan:
    """`chunk_rows`, with the weight's slice rows."""
    if budget_bytes is None or budget_bytes < 0:
        raise ValueError(f"budget_bytes: expected a number of bytes >= 0, got {budget_bytes!r}")
    dtype = dtype or (torch.float64 if weight_dtype == torch.float64 else torch.float32)
    size = dtype.itemsize
    row, whole = 2 * V * size, V * D * size  # bytes of a chunk row, of a [V, D] copy
    cols, fixed, what = V, 0, ""
    if weight_dtype != dtype:
        acc = whole if want_dw else 0
        what = f" beside the {_dt(dtype)} d weight of a {_dt(weight_dtype)} head" if acc else ""
        if acc > budget_bytes:
            return _Plan(None, V, f"the {_mib(budget_bytes)} chunk budget does not hold the "
                         f"{_dt(dtype)} d weight of a {_dt(weight_dtype)} head [{_n(V)}, {_n(D)}] "
                         f"({acc / 2**20:,.1f} MiB)")
        cols = max(1, min(V, SLICE_BYTES // max(D * size, 1)))
        fixed = acc + cols * D * size
        if (budget_bytes - acc - whole) // row >= max(1, min(n, (budget_bytes - fixed) // row)):
            cols, fixed = V, acc + whole  # room for one copy: converted once, not per chunk
    fit = (budget_bytes - fixed) // row
    if fit < 1 or fit < min(n, MIN_ROWS):
        return _Plan(None, cols, f"the {_mib(budget_bytes)} chunk budget holds {_n(max(fit, 0))} "
                     f"whole rows of V = {_n(V)}{what}, fewer than {_n(min(n, MIN_ROWS))}")
    rows = max(1, min(n, fit))
    return _Plan(rows, cols, f"chunks of {_n(rows)} whole rows of V = {_n(V)} within the "
                 f"{_mib(budget_bytes)} chunk budget" + (
                     f", the weight in slices of {_n(cols)} rows" if cols < V else ""))


def _n(x) -> str:
    """A count for a reason text, with thousands separators; "traced" under torch.compile,
    where a count may be a symbolic size and formatting it would fix it to its value (a guard),
    so that a compiled step would recompile at every new number of tokens."""
    return "traced" if torch.compiler.is_compiling() else f"{x:,}"


def _mib(n: int) -> str:
    return f"{n // 2**20:,} MiB" if n % 2**20 == 0 else f"{n:,}-byte"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Slices:
    """weight [V, D] in the compute dtype, one vocabulary slice [c, D] at a time: the weight
    itself (already that dtype), one copy made once (cols = V), or slices converted into one
    reused [cols, D] buffer each time they are iterated. Yields (v0, c, w [c, D])."""

    def __init__(self, weight, dtype, cols):
        self.weight, self.dtype, self.cols = weight, dtype, cols
        self.buf = tile_buffer(weight, dtype, cols)
        V = weight.shape[0]
        self.whole = weight_tile(weight, 0, V, dtype, self.buf) if cols >= V else None

    def __iter__(self):
        if self.whole is not None:
            yield 0, self.whole.shape[0], self.whole
            return
        for v0 in range(0, self.weight.shape[0], self.cols):
            w = weight_tile(self.weight, v0, self.cols, self.dtype, self.buf)
            yield v0, w.shape[0], w


def linear_loss_grad(hidden, weight, bias, targets, temperature,
                     d_logp: Callable[[int, int, torch.Tensor], torch.Tensor],
                     g_ent=None, rows=None, needs=(True, True, True), budget_bytes=None,
                     logit_scale=None, chunk_rows=None) -> LossGrad:
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N]; z = s·(h W^T + b) / τ.

    d_logp(r0, r, logp): for rows r0:r0 + r of the computed ones (in `rows` order), logp [r]
    float32 -> c = d L / d logp [r] float32; called once per chunk, in order. g_ent: [N] float32
    entropy coefficients g_H, or None. rows: int64 indices of the tokens to compute (None: all);
    the others get no statistics and a zero d hidden. needs: (d hidden, d weight, d bias).
    A logit scale s is a temperature here (`tiles.head_transform`); soft caps do not come here.
    budget_bytes: the chunk budget (None: CPU_BUDGET_BYTES), see `chunk_rows`; a ValueError with
    its reason when it declines. chunk_rows: rows per chunk, given (the budget then only sizes
    the weight's slices)."""
    temperature, _ = head_transform(temperature, None, logit_scale)
    want_dh, want_dw = bool(needs[0]), bool(needs[1])
    want_db = bias is not None and bool(needs[2])
    V, D = weight.shape
    dtype = compute_dtype(hidden, weight, bias)
    pick = functools.partial(pick_rows, idx=rows, dtype=dtype)  # [N, ...] -> [Na, ...]
    Na = hidden.shape[0] if rows is None else rows.numel()
    budget = CPU_BUDGET_BYTES if budget_bytes is None else budget_bytes
    plan = _plan(Na, V, D, weight.dtype, budget, dtype, want_dw)
    C = chunk_rows or plan.rows
    if C is None:
        raise ValueError(f"budget_bytes: {plan.reason}")
    logp, ent, lse = empty_stats(Na, hidden.device)
    coef = torch.zeros(Na, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        h, b, alpha = log2_head(pick(hidden), bias, dtype, temperature)  # [Na, D], z in log2
        tg, gh = pick(targets), pick(g_ent)
        w = _Slices(weight, dtype, plan.cols)
        z_buf, e_buf = (torch.empty(min(C, Na) * V, dtype=dtype, device=h.device)
                        for _ in range(2))
        dh = torch.empty_like(h) if want_dh else None  # [Na, D], every chunk writes its rows
        dw = None
        if want_dw:  # [V, D] in the compute dtype, the first chunk writes it
            dw = torch.empty_like(weight) if weight.dtype == dtype else torch.empty(
                V, D, dtype=dtype, device=h.device)
        db = torch.zeros(V, dtype=dtype, device=h.device) if want_db else None
        for r0, r, part in row_parts(Na, C):
            stats = [part(logp), part(ent), part(lse)]
            z = _logits(part(h), w, b, alpha, view(z_buf, r, V))
            z, e, s = _chunk_stats(z, part(tg)[:, None], view(e_buf, r, V), stats,
                                   keep_z=gh is not None)
            c = part(coef)
            c.copy_(d_logp(r0, r, stats[0]))
            x, scale = _d_logits(z, e, s, c.to(dtype), None if gh is None else part(gh),
                                 stats, part(tg)[:, None], -1.0 / temperature)
            x, scale, h_rows = _without_padding(x, scale, part(h), c,
                                                None if gh is None else part(gh))
            _accumulate(x, scale, h_rows, w, None if dh is None else part(dh), dw, db,
                        first=r0 == 0)
        d_hidden = None if dh is None else _scatter_rows(dh, hidden, rows)
        d_weight = None if dw is None else (dw if Na else dw.zero_()).to(weight.dtype)
        d_bias = None if db is None else db.to(bias.dtype)
    return LossGrad(logp, ent, lse, coef, d_hidden, d_weight, d_bias)


def _logits(h, w: _Slices, b, alpha, z):
    """z [r, V] = alpha·h @ W^T (+ b), log2 units, one weight slice at a time (a slice of z's
    columns is a strided view: the GEMM writes it in place)."""
    for v0, c, ws in w:
        logits_tile(h, ws, None if b is None else b[v0:v0 + c],
                    z if c == z.shape[1] else z[:, v0:v0 + c], alpha)
    return z


def _chunk_stats(z, col, e, out, keep_z: bool):
    """One chunk's statistics from its logits z [r, V] (log2 units; overwritten); col [r, 1]
    target columns, e [r, V] a buffer. Writes out = (logp, entropy, lse) [r] and returns
    (z - m [r, V] log2 units, overwritten unless keep_z, e = 2^(z - m) [r, V], s = Σ e [r])."""
    m = z.amax(dim=1)
    picked = z.gather(1, col).squeeze_(1).sub_(m)  # z_target - m
    z.sub_(m[:, None])
    torch.exp2(z, out=e)
    s = e.sum(dim=1)
    if keep_z:  # Σ e·(z - m) as r dot products: no [r, V] temporary
        t = torch.bmm(e[:, None, :], z[:, :, None]).view(-1)
    else:  # z - m is not needed any more: the product in its buffer, then the sum (faster)
        t = z.mul_(e).sum(dim=1)
    finish_stats(m, s, t, picked, out)  # leaves m and s as they were
    return z, e, s


def _d_logits(z, e, s, c, gh, out, col, neg_inv_t):
    """x [r, V] and its row scale σ (a [r, 1] tensor or a number) with d y = σ·x, d y the
    gradient of L w.r.t. the raw logits of the chunk (see the module docstring). z = z - m and
    e = 2^(z - m) [r, V] (log2 units; both may be overwritten), s = Σ e [r], c [r] = d L / d logp,
    gh [r] = g_H or None, out = (logp, entropy, lse) [r], col [r, 1] target columns."""
    if gh is None:
        # x = e - s·onehot, σ = -c/(s·τ): p - onehot = (e - s·onehot)/s
        e.scatter_add_(1, col, -s[:, None])
        return e, (c / s * neg_inv_t)[:, None]
    # x = p·(c + g_H·(ln p + H)) - c·onehot with p = e/s and ln p = ln2·(z - m) - ln s:
    # p·(a + k·(z - m)), a = c + g_H·(H - ln s), k = g_H·ln 2 (per token)
    _, ent, lse = out
    dtype = z.dtype
    log_s = torch.xlogy(1.0, s)  # ln s (torch.log forks threads, see tiles.finish_stats)
    a = (c + gh * (ent.to(dtype) - log_s)) / s
    k = gh * LN2 / s
    x = torch.addcmul(a[:, None], z, k[:, None], out=z).mul_(e)  # [r, V], in z's buffer
    x.scatter_add_(1, col, -c[:, None])
    return x, neg_inv_t


def _without_padding(x, scale, h, c, gh):
    """(x [r, V], scale, h [r, D]) with the rows of tokens without gradient (c = 0 and g_H = 0
    or None: padding of a batch that was not compacted) zeroed, so that a NaN or ±inf hidden
    state there adds 0 to the products (0·NaN would be NaN). On the CPU a free host read skips
    the work when every row has a gradient."""
    dead = ((c == 0) if gh is None else (c == 0) & (gh == 0))[:, None]
    if x.device.type == "cpu" and not bool(dead.any()):
        return x, scale, h
    if isinstance(scale, torch.Tensor):  # [r, 1]: c/s, NaN where s is
        scale = scale.masked_fill(dead, 0.0)
    return x.masked_fill_(dead, 0.0), scale, h.masked_fill(dead, 0.0)


def _accumulate(x, scale, h, w: _Slices, dh, dw, db, first: bool) -> None:
    """d y = scale·x for one chunk (x [r, V]; scale [r, 1] or a number): d hidden rows
    dh [r, D] = d y @ W (over the weight's slices), d W [V, D] (+)= d y^T @ h (written when
    `first`), d b [V] += Σ_rows d y."""
    per_row = isinstance(scale, torch.Tensor)
    if dh is not None:
        for v0, c, ws in w:  # the first slice writes dh
            xs = x if c == x.shape[1] else x[:, v0:v0 + c]
            torch.addmm(dh, xs, ws, beta=0.0 if v0 == 0 else 1.0, out=dh)
        dh.mul_(scale)
    if dw is not None:
        h_dw = h * scale if per_row else h
        torch.addmm(dw, x.T, h_dw, beta=0.0 if first else 1.0,
                    alpha=1.0 if per_row else scale, out=dw)
    if db is not None:
        if per_row:
            torch.addmv(db, x.T, scale.view(-1), out=db)
        else:
            db.add_(x.sum(dim=0), alpha=scale)


def _scatter_rows(dh, hidden, rows):
    """d hidden [N, D] in hidden's dtype from the computed rows' [Na, D]: zero elsewhere."""
    if rows is None:
        return dh.to(hidden.dtype)
    return torch.zeros_like(hidden).index_copy_(0, rows, dh.to(hidden.dtype))
