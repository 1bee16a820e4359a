"""The row kernels' variants (`kernels/logits_logprobs.py`, `kernels/logits_loss_grad.py`): as
the logits-input ops launch them on a model's [B, T, V] logits, and as the three-pass route
launches them on its float32 [C, V] logits chunk. `all_variants.variants` collects them."""

from __future__ import annotations

import itertools

from ..kernels import linear_loss_grad as llg
from ..kernels import logits_logprobs as lgt
from ..kernels import logits_loss_grad as lfused
from ..kernels import tile_configs
from .kernel_variants import (
    COMPLETION,
    ELEM,
    EPILOGUES,
    TOKENS,
    Variant,
    _epilogue_args,
    _split_cfg,
    _tag,
    _transform_args,
    _transform_tag,
    _with_transforms,
)
from .specialization import Ptr


def logits_variants(arch: int, V: int, dtype, quick: bool):
    e = ELEM[dtype]
    T = COMPLETION if V % 16 == 0 else COMPLETION - 1  # an odd T too: stride T·V not /16
    rows = dict(x_ptr=Ptr(e), tgt_ptr=Ptr("i64"), lse_ptr=Ptr("fp32"), ent_ptr=Ptr("fp32"),
                N=8 * T, V=V, T=T, stride_xb=T * V, stride_xt=V, inv_temp=1.0)
    for epi, tr in _with_transforms(EPILOGUES[:2] if quick else EPILOGUES, EPILOGUES[:2], quick):
        # with the epilogue, the logits-input loss skips blocks of weight 0 (ops.launch); m
        # and log s are written for the backward (`LogitsOp.forward`)
        fcfg, fopts = _split_cfg(tile_configs.logits(V, None, arch=arch,
                                                     softcap_backward=epi[0] and tr[1]))
        args = dict(rows, logp_ptr=Ptr("fp32"), max_ptr=Ptr("fp32"), logs_ptr=Ptr("fp32"),
                    **_epilogue_args(epi), **fcfg, SKIP_ZERO_WEIGHT=epi[0], SPLIT_LSE=True,
                    **_transform_args(tr))
        yield Variant(f"logits_fwd[{e},V={V},epi={_tag(epi)}{_transform_tag(tr)}]",
                      lgt._logits_logprob_fwd_kernel, args, fopts, "logits_fwd", True)
    for gent, tr in _with_transforms((False, True), (False, True), quick):
        bcfg, bopts = _split_cfg(tile_configs.logits(V, None, arch=arch,
                                                     softcap_backward=tr[1]))
        args = dict(_backward_rows(rows), dx_ptr=Ptr(e), glogp_ptr=Ptr("fp32"),
                    gent_ptr=Ptr("fp32"), logp_ptr=Ptr("fp32"), stride_db=T * V, stride_dt=V,
                    HAS_GENT=gent, ALIASED=False, SPLIT_LSE=True, **bcfg,
                    **_transform_args(tr))
        yield Variant(f"logits_bwd[{e},V={V},gent={gent}{_transform_tag(tr)}]",
                      lgt._logits_logprob_bwd_kernel, args, bopts, "logits_bwd", True)
    # before each logits-input backward: the rows its forward skipped, recomputed if needed
    stats = {k: v for k, v in rows.items() if k != "tgt_ptr"} | {
        k: Ptr("fp32") for k in ("lse_out_ptr", "ent_out_ptr", "glogp_ptr", "gent_ptr")}
    for gent, tr in _with_transforms((False, True), (True, False), quick):
        scfg, sopts = _split_cfg(tile_configs.logits(V, None, arch=arch, softcap_backward=tr[1]))
        args = dict(stats, HAS_GENT=gent, **scfg, **_transform_args(tr))
        yield Variant(f"logits_skipped[{e},V={V},gent={gent}{_transform_tag(tr)}]",
                      lgt._skipped_rows_kernel, args, sopts, "logits_skipped", True)


def _backward_rows(rows: dict) -> dict:
    """The row backward's arguments of the forward's `rows`: the lse as the shift beside log s
    (`logits_logprobs._logits_logprob_bwd_kernel`)."""
    return {k: v for k, v in rows.items() if k != "lse_ptr"} | dict(shift_ptr=Ptr("fp32"),
                                                                     logs_ptr=Ptr("fp32"))


def three_pass_variants(arch: int, V: int, gemm_dtype, quick: bool):
    """The row kernels as the three-pass route (kernels/linear_loss_grad.py) launches them: on
    its float32 [C, V] logits chunk viewed as [C, 1, V] (T = 1, both strides V; chunks of
    ALIGN_ROWS rows keep every chunk's [N] pointers aligned), the forward always with the GRPO
    epilogue, the backward writing d logits in the GEMM dtype (the weight's) over the logits
    chunk (`llg.dlogits_over`: a 16-bit d logits row in the first half of its row's bytes, row
    stride 2V; a barrier before each store)."""
    C = llg.chunk_rows(TOKENS[0], V, 4096, llg.CUDA_BUDGET_BYTES)
    rows = dict(x_ptr=Ptr("fp32"), tgt_ptr=Ptr("i64"), lse_ptr=Ptr("fp32"), ent_ptr=Ptr("fp32"),
                N=C, V=V, T=1, stride_xb=V, stride_xt=V, inv_temp=1.0)
    cfg, opts = _split_cfg(tile_configs.logits(V, None, arch=arch))
    for epi, tr in _with_transforms(EPILOGUES[1:], EPILOGUES[1:2], quick):
        args = dict(rows, logp_ptr=Ptr("fp32"), max_ptr=Ptr("fp32"), logs_ptr=Ptr("fp32"),
                    **_epilogue_args(epi), **cfg, SKIP_ZERO_WEIGHT=False, SPLIT_LSE=True,
                    **_transform_args(tr))
        yield Variant(f"logits_fwd[fp32,three-pass,V={V},epi={_tag(epi)}{_transform_tag(tr)}]",
                      lgt._logits_logprob_fwd_kernel, args, opts, "logits_fwd", True)
    d = ELEM[gemm_dtype]
    d_stride = V * 4 // gemm_dtype.itemsize  # the d logits' row stride over the logits' rows
    aliased = d != "fp32"  # a narrower d logits over the logits: the barrier (shared_rows)
    for gent, tr in _with_transforms((False, True), (True, False), quick):
        bcfg, bopts = _split_cfg(tile_configs.logits(V, None, arch=arch, softcap_backward=tr[1],
                                                     converting_backward=d != "fp32"))
        args = dict(_backward_rows(rows), dx_ptr=Ptr(d), glogp_ptr=Ptr("fp32"),
                    gent_ptr=Ptr("fp32"), logp_ptr=Ptr("fp32"), stride_db=d_stride,
                    stride_dt=d_stride, HAS_GENT=gent, ALIASED=aliased, SPLIT_LSE=True, **bcfg,
                    **_transform_args(tr))
        yield Variant(f"logits_bwd[fp32->{d},three-pass,V={V},gent={gent}{_transform_tag(tr)}]",
                      lgt._logits_logprob_bwd_kernel, args, bopts, "logits_bwd", True)
    # the fused row kernel (fused_rows=True: an option, not the default)
    fused = itertools.product(EPILOGUES[1:2] if quick else EPILOGUES[1:], (False, True))
    for (epi, gent), tr in _with_transforms(fused, ((EPILOGUES[1], True),), quick):
        fcfg, fopts = _split_cfg(tile_configs.logits(V, None, arch=arch, softcap_backward=tr[1],
                                                     converting_backward=d != "fp32",
                                                     fused=True))
        args = dict(rows, dx_ptr=Ptr(d), logp_ptr=Ptr("fp32"), gent_ptr=Ptr("fp32"),
                    stride_db=d_stride, stride_dt=d_stride, HAS_GENT=gent, ALIASED=True,
                    **_epilogue_args(epi), **fcfg, **_transform_args(tr))
        yield Variant(f"logits_fused[fp32->{d},V={V},epi={_tag(epi)},gent={gent}"
                      f"{_transform_tag(tr)}]", lfused._logits_loss_grad_kernel, args, fopts,
                      "logits_fused", False)
