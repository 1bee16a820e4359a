"""Triton kernel: the row forward with the GRPO epilogue and the row backward in one program per
block of rows (an option of the three-pass route, `linear_loss_grad.py`: `fused_rows`).

Each row block is swept twice: its statistics (`logits_logprobs._forward_rows`: m, log s, the
entropy, logp and the epilogue's coefficient), then its d logits (`logits_logprobs._d_logits_sweep`)
with p = e^((z - m) - log s) from the first sweep's registers, as `logits_logprob_backward` reads
it given the forward's `split_out`: the same numbers as the two kernels, no per-row traffic between
them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import tile_configs
from .epilogue import EPILOGUE
from .logit_transform import logit_transform_args
from .logits_logprobs import (
    _d_logits_sweep,
    _forward_rows,
    _nonzero_rows,
    _row_offsets,
    shared_rows,
)


@triton.jit(do_not_specialize=["N", "T"])
def _logits_loss_grad_kernel(
    x_ptr, dx_ptr, tgt_ptr, lse_ptr, ent_ptr, logp_ptr, gent_ptr,
    epi_tensors, epi_scalars,  # the GRPO epilogue's bundle (epilogue.py); EPI_FLAGS has it on
    N, V, T, stride_xb, stride_xt, stride_db, stride_dt, inv_temp, logit_mul, softcap,
    EPI_FLAGS: tl.constexpr, HAS_GENT: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ALIASED: tl.constexpr,
):
    # the forward's sweep and epilogue, then the backward's sweep with g_logp = weight·dℓ/dlogp
    # from registers, p read against the forward's m and log s (not through the lse): the
    # second read of a row block may come from L2
    offs_n, n_mask, rows, m, log_s, ent, logp, g = _forward_rows(
        x_ptr, tgt_ptr, lse_ptr, ent_ptr, logp_ptr, lse_ptr, lse_ptr, epi_tensors, epi_scalars,
        N, V, T, stride_xb, stride_xt, inv_temp, logit_mul, softcap, EPI_FLAGS, ROWS, BLOCK_V,
        HAS_SCALE, HAS_SOFTCAP, False, False)
    busy = _nonzero_rows(g)
    gh = g
    if HAS_GENT:
        gh = tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0)
        busy += _nonzero_rows(gh)
    m = tl.where(n_mask, m, 0.0)  # rows past N: finite, as the backward loads them
    # the one-hot term at the id as given: none for an id outside [0, V), as in the backward
    # kernel (another vocabulary shard's id, grpo_kernels/parallel); the sweep loads nothing by it
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=-1)
    _d_logits_sweep(x_ptr, dx_ptr, rows, _row_offsets(offs_n, T, stride_db, stride_dt), n_mask,
                    tgt, m, log_s, ent, logp, g, gh, busy, V, inv_temp, logit_mul, softcap,
                    HAS_GENT, ROWS, BLOCK_V, HAS_SCALE, HAS_SOFTCAP, ALIASED)


def logits_loss_grad(logits, targets, temperature, epilogue, g_ent, out, dx, softcap=None,
                     logit_scale=None) -> None:
    """`logits_logprob_forward` with the GRPO epilogue, then `logits_logprob_backward` with
    g_logp = the epilogue's weight·dℓ/dlogp, in one program per block of rows (each row swept
    twice: its statistics, then its d logits). logits [B, T, V]; targets [B·T] int64; epilogue:
    the bundle (`epilogue.epilogue_args`, on), whose outputs it fills; g_ent [B·T] float32 or
    None; out: (logp, entropy, lse) [B·T] float32 to write; dx [B, T, V]: the d logits (any
    float dtype; a buffer of its own, the logits themselves, or a narrower view over their rows:
    `shared_rows`)."""
    if not EPILOGUE.value & epilogue.flags:
        raise ValueError("logits_loss_grad needs the GRPO epilogue (epilogue.epilogue_args)")
    B, T, V = logits.shape
    N = B * T
    if N == 0:
        return
    logp, ent, lse = out
    aliased = shared_rows(logits, dx)  # the forward sweep's reads, too, precede any write
    cfg = tile_configs.logits(V, logits.device, softcap_backward=softcap is not None,
                              converting_backward=dx.dtype != logits.dtype, fused=True)
    _logits_loss_grad_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
        logits, dx, targets, lse, ent, logp, g_ent if g_ent is not None else logp,
        epilogue.tensors, epilogue.scalars,
        N, V, T, logits.stride(0), logits.stride(1), dx.stride(0), dx.stride(1),
        1.0 / temperature, EPI_FLAGS=epilogue.flags, HAS_GENT=g_ent is not None,
        ALIASED=aliased, **cfg, **logit_transform_args(softcap, logit_scale),
    )
