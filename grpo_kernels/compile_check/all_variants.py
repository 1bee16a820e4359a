"""The whole list of kernel variants `compile_check` compiles for one GPU architecture: the
linear head's (`kernel_variants.py`) and the three-pass route's and logits-input ops' row kernels
(`row_variants.py`), each distinct binary once, marked `default` where it runs with no opt-in
setting."""

from __future__ import annotations

import itertools
import os

import torch
import triton

from ..kernels import tile_configs
from ..ops.backends import BACKWARD_ENV, linear_backward_mode
from .kernel_variants import (
    BACKWARD_KERNELS,
    DTYPE_PAIRS,
    HEADS,
    TOKENS,
    Variant,
    _combine,
    _fp32_precisions,
    _linear,
    forward_grid,
)
from .row_variants import logits_variants, three_pass_variants
from .specialization import signature_of


def default_linear_backward() -> str:
    """The backward the dispatch picks with no setting (no grad_filter, variable unset)."""
    saved = os.environ.pop(BACKWARD_ENV, None)
    try:
        return linear_backward_mode(None)
    finally:
        if saved is not None:
            os.environ[BACKWARD_ENV] = saved


def variants(arch: int, quick: bool = False) -> list:
    """Distinct variants (a variant reached from several shapes is compiled once).

    `default` marks what runs with no opt-in setting: the default linear backward
    (GRPO_KERNELS_LINEAR_BACKWARD unset), no gradient filter, PyTorch's default float32 matmul
    precision ("highest"), and the split choice of the default `num_splits` on a typical GPU
    of that architecture. Dtypes, bias, epilogue flags and vocabularies come from the user's
    model and loss, so all of them count as default. `quick` keeps every kernel, dtype, tile
    configuration and specialization, but fewer epilogue and flag combinations."""
    defaults = {"fwd", *BACKWARD_KERNELS[default_linear_backward()]}
    precs = _fp32_precisions()
    out, seen = [], {}
    pairs = DTYPE_PAIRS[:1] + DTYPE_PAIRS[2:4] if quick else DTYPE_PAIRS
    heads = (HEADS[0], HEADS[-1]) if quick else HEADS
    for hdt, wdt in pairs:
        for prec in precs if hdt == torch.float32 else ("tf32",):
            for (D, V), N in itertools.product(heads, TOKENS[:1] if quick else TOKENS):
                dflt = defaults if prec == precs[0] or hdt != torch.float32 else set()
                for v in _linear(arch, N, D, V, hdt, wdt, prec, quick, dflt):
                    v.shape = (N, D, V)
                    _add(out, seen, v)
        if hdt != wdt:
            continue
        for V in sorted({v for _, v in heads}):
            for v in logits_variants(arch, V, hdt, quick):
                _add(out, seen, v)
    for wdt in dict.fromkeys(w for _, w in pairs):  # the three-pass route's GEMM dtypes
        for V in sorted({v for _, v in heads}):
            for v in three_pass_variants(arch, V, wdt, quick):
                _add(out, seen, v)
    default_blocks = {triton.next_power_of_2(tile_configs.split_cap(grid[1]))
                      for hdt, _ in pairs for (D, V), N in itertools.product(heads, TOKENS)
                      if (grid := forward_grid(arch, N, D, V, hdt))[2] > 1}
    for v in _combine(quick, arch, default_blocks):
        _add(out, seen, v)
    return out


def _add(out: list, seen: dict, v: Variant) -> None:
    sig, constexprs, attrs = signature_of(v.kernel, v.args)
    key = (v.kernel.__name__, tuple(sig.items()), tuple(sorted(constexprs.items())),
           tuple(sorted(attrs)), tuple(sorted(v.options.items())))
    if key in seen:  # the same binary: default if any of its launches is
        seen[key].default |= v.default
        return
    if any(w.name == v.name for w in out):  # same flags, other tiles (shape-dependent config)
        v.name = f"{v.name}#{sum(w.name.startswith(v.name) for w in out) + 1}"
    seen[key] = v
    out.append(v)
