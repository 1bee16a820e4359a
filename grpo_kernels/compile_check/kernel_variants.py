"""Every kernel variant the launchers can launch on one GPU architecture, with the arguments the
runtime sees, for `compile_check`.

Each `Variant` holds the full argument list of one launch (tensors as `Ptr`, integers, floats and
the constexpr flags) at a realistic shape, built the way the launcher builds it: tile shapes and
options from the launchers' own `tile_configs` functions, the dot precision from `precision`.
`specialization.signature_of` then applies Triton's JITFunction specialization, so what is
compiled is what the runtime would compile for that launch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton

from ..kernels import accumulate_mm as amm
from ..kernels import linear_backward_atomic as atomic
from ..kernels import linear_backward_gemm as gemm
from ..kernels import linear_logprobs as lin
from ..kernels import precision, tile_configs
from ..kernels.epilogue import epilogue_flags
from ..loss_specs import CLIPPED, OBJECTIVES
from .specialization import Ptr

ELEM = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# The heads users train (D, V): Qwen2.5-0.5B, Qwen2.5-7B, Llama-3-8B, Llama-2 and a vocabulary
# of 32001 (Llama-2 plus a pad token), which is not a multiple of 16: the runtime specializes V
# and the V-strides on divisibility by 16, so both kinds of vocabulary compile differently.
HEADS = ((896, 151936), (3584, 151936), (4096, 128256), (4096, 32000), (4096, 32001))
TOKENS = (16384, 4096)  # N = B·T
COMPLETION = 1024  # T of the [B, T, V] logits (the logits kernels' batch stride is T·V)
# An epilogue variant: (epilogue on, LOSS_KIND, old, delta, kl, bias-corrected kl, isr), turned
# into the kernels' EPI_FLAGS by `kernels.epilogue.epilogue_flags` (`_epilogue_args`).
KERNEL_CLIPPED = CLIPPED.kernel_code
# every per-token objective of the registry with every option on (its heaviest epilogue)
_OTHER_KINDS = sorted(o.kernel_code for o in OBJECTIVES if not o.per_sequence and o is not CLIPPED)
EPILOGUES = (
    (False, KERNEL_CLIPPED, False, False, False, False, False),  # log-probs only
    (True, KERNEL_CLIPPED, True, True, True, True, True),  # clipped loss, every option on
    (True, KERNEL_CLIPPED, False, False, False, False, False),  # clipped, on-policy, no KL
    (True, KERNEL_CLIPPED, True, False, True, False, False),
    *((True, kind, True, True, True, True, True) for kind in _OTHER_KINDS),
)
KIND_TAGS = {o.kernel_code: "clip" if o is CLIPPED else o.name  # in variant names
             for o in OBJECTIVES if not o.per_sequence}
# The logit transform (kernels/logit_transform.py) as (HAS_SCALE, HAS_SOFTCAP): off, a logit scale
# alone (Cohere), a soft cap (Gemma 2; with a scale too, the same code: the scale rides in
# logit_mul). Its variants are compiled for a subset of the other flags (TRANSFORM_FWD/BWD),
# every dtype, head and tile configuration; they come from the model, so they count as default.
TRANSFORMS = ((True, False), (False, True))
TRANSFORM_FWD = ((False, False, 0), (False, True, 1), (True, False, 0), (True, True, 1))
TRANSFORM_BWD = (((True, True), False, False, False), ((True, True), True, True, False),
                 ((True, False), False, True, False), ((False, True), True, False, False),
                 ((True, True), False, True, True))
# --quick: (split, bias, epilogue) of the forward and (needs, bias, gent, filter) of the backwards
QUICK_FWD = ((False, False, EPILOGUES[0]), (False, True, EPILOGUES[1]),
             (True, False, EPILOGUES[0]), (True, True, EPILOGUES[1]))
QUICK_BWD = (((True, True), False, False, False), ((True, True), False, True, False),
             ((True, False), False, False, False), ((False, True), False, False, False),
             ((True, True), False, False, True), ((True, True), True, True, True))
# typical SM counts (H100 SXM 132, A100 108, ...) for the split count of the forward
SMS = {75: 40, 80: 108, 86: 84, 87: 16, 89: 128, 90: 132, 100: 148, 103: 148, 120: 170, 121: 48}
# Default linear-head backward (GRPO_KERNELS_LINEAR_BACKWARD unset) and its kernels.
BACKWARD_KERNELS = {"atomic": ("linear_bwd",), "gemm": ("linear_dz",)}
# (hidden dtype, head weight dtype); a float32 head with 16-bit hidden is the mixed head
DTYPE_PAIRS = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
               (torch.float16, torch.float32))


@dataclass
class Variant:
    name: str
    kernel: object  # the @triton.jit function
    args: dict  # every parameter of the kernel by name
    options: dict  # num_warps, num_stages, enable_fp_fusion
    kind: str  # linear_fwd, combine, linear_bwd, linear_dz, logits_fwd, logits_bwd, logits_fused
    default: bool  # launched by the default configuration (see `variants`)
    shape: tuple = ()  # (N, D, V) it was built for (the first one, when several coincide)


def _split_cfg(cfg: dict) -> tuple:
    opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")
            if k in cfg}
    return cfg, opts


def _fp32_precisions() -> tuple:
    """Every input_precision `precision.dot_precision` gives float32 (PyTorch's "highest" and
    "high" matmul settings), the default ("highest") first."""
    before = torch.get_float32_matmul_precision()
    try:
        found = []
        for mode in ("highest", "high"):
            torch.set_float32_matmul_precision(mode)
            found.append(precision.dot_precision(torch.float32))
        return tuple(dict.fromkeys(found))
    finally:
        torch.set_float32_matmul_precision(before)


def _epilogue_args(epi: tuple) -> dict:
    """The epilogue bundle's kernel arguments (kernels.epilogue.EpilogueArgs): its [N] tensors
    are float32 (when there is no epilogue the launcher passes logp, float32, in their place),
    its scalars floats, its flags one constexpr."""
    on, kind, old, delta, kl, bckl, isr = epi
    flags = epilogue_flags(kind, old=old, delta=delta, kl=kl, bias_correct_kl=bckl, isr=isr)
    return dict(epi_tensors=(Ptr("fp32"),) * 9, epi_scalars=(0.2,) * 6,
                EPI_FLAGS=flags if on else 0)


def _transform_args(flags: tuple) -> dict:
    return dict(logit_mul=0.5, softcap=30.0, HAS_SCALE=flags[0], HAS_SOFTCAP=flags[1])


def _transform_tag(flags: tuple) -> str:
    return "" if not any(flags) else ",logit=softcap" if flags[1] else ",logit=scale"


def _with_transforms(plain, subset, quick: bool):
    """(flags, transform) pairs: every flag combination untransformed, then `subset` of them
    (its first with --quick) with each transform."""
    for flags in plain:
        yield flags, (False, False)
    for tr in TRANSFORMS:
        for flags in subset[:1] if quick else subset:
            yield flags, tr


def _tag(epi: tuple) -> str:
    if not epi[0]:
        return "none"
    kind = KIND_TAGS[epi[1]]
    flags = [n for n, on in zip(("old", "delta", "kl", "bckl", "isr"), epi[2:]) if on]
    return "+".join([kind, *flags])


def forward_grid(arch: int, N: int, D: int, V: int, dtype) -> tuple:
    """(token blocks, vocabulary tiles, splits S, tiles per split) as the forward launcher
    computes them, on a GPU with the typical SM count of `arch`."""
    cfg = tile_configs.linear_fwd(N, V, D, dtype, None, arch=arch)
    n_blocks = triton.cdiv(N, cfg["BLOCK_N"])
    n_tiles = triton.cdiv(V, cfg["BLOCK_V"])
    S = tile_configs.num_splits(n_blocks, n_tiles, cfg["GROUP_N"], None, sms=SMS[arch])
    per_split = triton.cdiv(n_tiles, S)
    return n_blocks, n_tiles, triton.cdiv(n_tiles, per_split), per_split


def _linear(arch: int, N: int, D: int, V: int, hdt, wdt, prec: str, quick: bool,
            defaults: set):
    """The linear head's forward and backward kernels at one shape, for hidden dtype `hdt` and
    head weight dtype `wdt` (a float32 head with 16-bit hidden is the mixed-precision head)."""
    h, w = ELEM[hdt], ELEM[wdt]
    dt = h if h == w else f"{h}x{w}"
    vtag = f"V%16={V % 16}"
    fcfg, fopts = _split_cfg(tile_configs.linear_fwd(N, V, D, hdt, None, arch=arch))
    n_blocks, n_tiles, S, per_split = forward_grid(arch, N, D, V, hdt)
    heads = dict(h_ptr=Ptr(h), w_ptr=Ptr(w), tgt_ptr=Ptr("i64"), lse_ptr=Ptr("fp32"),
                 ent_ptr=Ptr("fp32"), V=V, D=D, stride_hn=D, stride_wv=D, inv_temp=1.0)
    combos = itertools.product((False, True), (False, True), EPILOGUES)
    subset = tuple((split, bias, EPILOGUES[e]) for split, bias, e in TRANSFORM_FWD)
    for (split, bias, epi), tr in _with_transforms(QUICK_FWD if quick else combos, subset,
                                                   quick):
        args = dict(heads, b_ptr=Ptr(w if bias else h), part_ptr=Ptr("fp32"),
                    logp_ptr=Ptr("fp32"), N=N, n_blocks=n_blocks, n_splits=S if split else 1,
                    tiles_per_split=per_split if split else n_tiles, HAS_BIAS=bias,
                    SPLIT=split, DOT_PREC=prec, **_epilogue_args(epi), **fcfg,
                    **_transform_args(tr))
        yield Variant(f"linear_fwd[{dt},{prec},split={split},bias={bias},epi={_tag(epi)},"
                      f"{vtag}{_transform_tag(tr)}]", lin._linear_logprob_fwd_kernel, args,
                      fopts, "linear_fwd", "fwd" in defaults and split == (S > 1))
    grads = dict(glogp_ptr=Ptr("fp32"), gent_ptr=Ptr("fp32"), filter_eps=0.0)
    # atomic backward (the default only with gradient filtering)
    bcfg, bopts = _split_cfg(
        tile_configs.linear_bwd_atomic(hdt, None, arch=arch, weight_dtype=wdt))
    plain = QUICK_BWD[-2:] if quick else _backward_flags(False)
    for ((dh, dw), bias, gent, filt), tr in _with_transforms(plain, TRANSFORM_BWD[::-1], quick):
        args = dict(heads, **grads, b_ptr=Ptr(w if bias else h), dh_ptr=Ptr("fp32"),
                    dw_ptr=Ptr("fp32"), db_ptr=Ptr("fp32"), N=N, v_begin=0, v_count=V,
                    stride_dh=D, stride_dw=D, n_blocks=triton.cdiv(N, bcfg["BLOCK_N"]),
                    v_blocks=triton.cdiv(V, bcfg["BLOCK_V"]), HAS_BIAS=bias, HAS_GENT=gent,
                    FILTER=filt, COMPUTE_DH=dh, COMPUTE_DW=dw, COMPUTE_DB=bias and dw,
                    DOT_PREC=prec, **bcfg, **_transform_args(tr))
        yield Variant(f"linear_bwd[{dt},{prec},dh={dh},dw={dw},bias={bias},gent={gent},"
                      f"filter={filt},{vtag}{_transform_tag(tr)}]",
                      atomic._linear_logprob_bwd_kernel, args, bopts, "linear_bwd",
                      "linear_bwd" in defaults and not filt)
    yield from _gemm_backward(arch, N, D, V, hdt, wdt, prec, quick, defaults, heads, grads,
                              vtag, dt)


def _backward_flags(quick: bool):
    """((need d hidden, need d weight), bias, entropy gradient, gradient filter)."""
    if quick:
        return QUICK_BWD
    needs = ((True, True), (True, False), (False, True))
    return itertools.product(needs, (False, True), (False, True), (False, True))


def _gemm_backward(arch, N, D, V, hdt, wdt, prec, quick, defaults, heads, grads, vtag, dt):
    """d-logits kernel and accumulate_mm as `linear_logprob_backward_gemm` launches them: chunk
    sizes and orientation from its own functions, so strides are the real ones."""
    common = torch.promote_types(hdt, wdt)
    c = ELEM[common]
    budget = gemm.dz_budget_bytes(N, V)
    flags = _with_transforms(_backward_flags(quick), TRANSFORM_BWD, quick)
    for ((dh, dw), bias, gent, filt), tr in flags:
        zcfg, zopts = _split_cfg(tile_configs.linear_dz(common, None, arch=arch,
                                                        entropy_grad=gent, softcap=tr[1]))
        BN, BV = zcfg["BLOCK_N"], zcfg["BLOCK_V"]
        need_db = bias and dw
        rows, cols = gemm.chunk_sizes(N, V, BN, BV, common.itemsize + (4 / BN if need_db else 0),
                                      budget)
        orientation = gemm.pick_orientation(N, V, D, rows, cols, dh, dw)
        by_tokens = orientation == "tokens"
        dz_cols = V if by_tokens else min(cols, V)
        n_count = min(rows, N) if by_tokens else N
        args = dict(heads, **grads, b_ptr=Ptr(ELEM[wdt] if bias else ELEM[hdt]), dz_ptr=Ptr(c),
                    dbp_ptr=Ptr("fp32"), n0=0, n_count=n_count, v0=0, v_count=dz_cols,
                    stride_dz=dz_cols, stride_dbp=dz_cols if need_db else 1,
                    n_blocks=triton.cdiv(n_count, BN), v_blocks=triton.cdiv(dz_cols, BV),
                    HAS_BIAS=bias, HAS_GENT=gent, FILTER=filt, COMPUTE_DB=need_db,
                    DOT_PREC=prec, **zcfg, **_transform_args(tr))
        yield Variant(f"linear_dz[{dt},{prec},{orientation},dh={dh},dw={dw},bias={bias},"
                      f"gent={gent},filter={filt},{vtag}{_transform_tag(tr)}]",
                      gemm._linear_dz_kernel, args, zopts, "linear_dz",
                      "linear_dz" in defaults and not filt)
        summed = (dw if by_tokens else dh) and (rows < N if by_tokens else cols < V)
        if not summed or common == torch.float32:
            continue  # one chunk: library GEMMs only; float32: acc.addmm_
        yield _accumulate(arch, c, common, by_tokens, n_count, dz_cols, D, N,
                          "linear_dz" in defaults and not filt)


def _accumulate(arch, c, dtype, a_t, rows, cols, D, N, default):
    """accumulate_mm: by tokens acc = d weight [V, D] += dz^T [V, rows] @ hidden [rows, D];
    by vocabulary acc = d hidden [N, D] += dz [N, cols] @ weight [cols, D]."""
    acfg, aopts = _split_cfg(tile_configs.accumulate_mm(dtype, None, arch=arch))
    M, K = (cols, rows) if a_t else (N, cols)
    args = dict(a_ptr=Ptr(c), b_ptr=Ptr(c), acc_ptr=Ptr("fp32"), M=M, K=K, D=D,
                stride_a=cols, stride_b=D, stride_acc=D,
                m_blocks=triton.cdiv(M, acfg["BLOCK_M"]), d_blocks=triton.cdiv(D, acfg["BLOCK_D"]),
                A_T=a_t, DOT_PREC="tf32", **acfg)
    return Variant(f"accumulate_mm[{c},A_T={a_t},stride_a%16={cols % 16}]",
                   amm._accumulate_mm_kernel, args, aopts, "accumulate_mm", default)


def _combine(quick: bool, arch: int, default_blocks: set):
    """The split-combine kernel for every power-of-two BLOCK_S up to MAX_SPLITS (--quick: the
    default ones and the largest). S is not specialized: one binary per BLOCK_S serves every
    split count. Default: the BLOCK_S the launcher takes for the vocabularies above."""
    top = triton.next_power_of_2(tile_configs.MAX_SPLITS)
    sizes = sorted(default_blocks | {top}) if quick else [2**i for i in range(1, 7)]
    for block_s, epi in itertools.product(sizes, EPILOGUES[:2] if quick else EPILOGUES):
        cfg, opts = _split_cfg(tile_configs.combine(block_s, None, arch=arch))
        args = dict(part_ptr=Ptr("fp32"), lse_ptr=Ptr("fp32"), ent_ptr=Ptr("fp32"),
                    logp_ptr=Ptr("fp32"), N=16384, S=block_s, **_epilogue_args(epi), **cfg)
        yield Variant(f"combine[BLOCK_S={cfg['BLOCK_S']},epi={_tag(epi)}]",
                      lin._combine_splits_kernel, args, opts, "combine",
                      block_s in default_blocks)
