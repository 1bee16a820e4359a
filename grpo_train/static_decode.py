"""The static-cache generation path (--generation static): `model.generate` on the left-padded
batch with transformers' StaticCache (fixed-size key/value tensors, updated in place) and, with
--static_compile, its decode step compiled by torch.compile, as transformers documents it
(`CompileConfig`: mode "reduce-overhead", which records CUDA graphs on a GPU). The prefill runs
uncompiled (transformers compiles the one-token decode step only).

What is done here rather than by `generate(cache_implementation="static")`, and why:
  - the cache is built here and kept across calls of the same shape (`run.static_caches`, a few
    at most), reset before each call: a compiled decode step, and on CUDA its graphs, are tied to
    the cache tensors' addresses, which a cache built per call would change;
  - its length is the prompt columns plus max_new_tokens rounded up to `LENGTH_STEP` positions,
    so that steps whose prompts differ by a few tokens reuse one cache and one compiled graph;
  - each prompt's prefill is computed once for its G completions where the padded path's can be
    (`generation._prefill_refusal`) and the cache holds only full-attention layers: the P
    prompts' keys and values, repeated G times, are written into the static cache's first
    Lp - 1 positions, and `generate` runs the last prompt token of every row on it.

Greedy completions are those of `model.generate` (tests/train/test_generation.py): the static
cache attends over its whole length with the unwritten positions masked out, so the logits agree
up to the rounding of longer sums.
"""

from __future__ import annotations

from . import continuous

LENGTH_STEP = 64  # cache positions are rounded up to a multiple of this
KEPT_CACHES = 4  # caches of distinct shapes kept across calls (training batch, eval batches)
# "auto" takes the compiled static path only for runs of at least this many decode steps
# (steps x max_new_tokens). On an H200 (benchmarks.generation, trainer-64: Qwen2.5-0.5B shape,
# bf16, B = 8, cap 1,024) the compiled decode saved 14 ms a decode step against the padded path
# (3.70 s against 18.05 s for 1,024 steps), and the compile took about 65 s (an estimate: the
# call's wall time less its timed calls), so it pays back after about 4,600 decode steps.
AUTO_MIN_DECODE_STEPS = 4608


def unsupported_reason(model, cfg, auto: bool = False) -> str | None:
    """Why the static path cannot serve this run, or None; auto: the path is the device rule's
    choice, not asked for, so a compile that would not pay back is refused too."""
    try:
        from transformers import CompileConfig, StaticCache  # noqa: F401
    except ImportError as err:
        return f"this transformers has no StaticCache / CompileConfig ({err})"
    hf = continuous.base_model(model)
    name = type(hf).__name__
    reason = continuous.own_cache_reason(hf)
    if reason is not None:
        return reason
    if cfg.fsdp:
        return "--fsdp: a compiled decode of sharded parameters is untested here"
    if getattr(cfg, "tp_size", 1) > 1:
        return "--tp_size: a static cache of tensor-parallel layers is untested here"
    if cfg.static_compile and not getattr(hf, "_can_compile_fullgraph", False):
        return f"{name} does not declare a compilable forward (_can_compile_fullgraph)"
    decodes = (cfg.steps or 0) * (cfg.max_new_tokens or 0)
    if auto and cfg.static_compile and decodes < AUTO_MIN_DECODE_STEPS:
        return (f"{cfg.steps} steps x {cfg.max_new_tokens} new tokens = {decodes:,} decode "
                f"steps, fewer than the {AUTO_MIN_DECODE_STEPS:,} that repay compiling the "
                "decode step")
    return None


def compile_settings(model, cfg) -> tuple[dict, str]:
    """(generate's keywords for the decode step, a phrase for the log line): compiled with
    mode "reduce-overhead" on CUDA (CUDA graphs), inductor's default mode elsewhere (forced on,
    as transformers compiles on accelerators only); not compiled with --no_static_compile."""
    from transformers import CompileConfig

    if not cfg.static_compile:
        return dict(disable_compile=True), "decode not compiled (--no_static_compile)"
    device = next(model.parameters()).device
    if device.type == "cuda":
        return (dict(compile_config=CompileConfig(mode="reduce-overhead")),
                "decode compiled (torch.compile, reduce-overhead: CUDA graphs)")
    config = CompileConfig(mode="default")
    config._compile_all_devices = True  # transformers' switch for compiling on a CPU
    return dict(compile_config=config), f"decode compiled (torch.compile on {device.type})"


def cache_length(prompt_columns: int, max_new_tokens: int) -> int:
    """Positions of the static cache: Lp + max_new_tokens rounded up to LENGTH_STEP."""
    need = prompt_columns + max_new_tokens
    return -(-need // LENGTH_STEP) * LENGTH_STEP


def static_cache(model, run, batch: int, length: int):
    """An empty StaticCache of `batch` rows and `length` positions, the same object for every
    call of that shape (reset first); at most KEPT_CACHES are kept (the oldest goes)."""
    from transformers import StaticCache

    hf = continuous.base_model(model)
    caches = run.static_caches
    dtype = next(model.parameters()).dtype
    key = (batch, length, dtype)
    cache = caches.pop(key, None)
    if cache is None:
        cache = StaticCache(config=hf.config.get_text_config(decoder=True), max_cache_len=length)
        values_keep_their_dtype(cache)
    else:
        cache.reset()
    caches[key] = cache  # most recently used last
    while len(caches) > KEPT_CACHES:
        caches.pop(next(iter(caches)))
    return cache


def values_keep_their_dtype(cache) -> None:
    """Makes each layer of `cache` (a DynamicCache or StaticCache) hold its values in the dtype
    of the first values written, as transformers 5.24 does.

    Under bf16 autocast with float32 weights the keys leave the rotary embedding in float32 and
    the values stay bf16. transformers before 5.24 (5.17 among them) allocates a layer's values
    in the keys' dtype: a DynamicLayer then promotes the prompts' values to float32, and a
    StaticLayer refuses the decode step's bf16 values (index_copy_ needs one dtype), so the
    static path failed under --bf16. Where the dtypes already agree this changes nothing."""
    import torch
    from transformers.cache_utils import StaticLayer

    for layer in getattr(cache, "layers", ()):
        init = getattr(layer, "lazy_initialization", None)
        if init is None:
            continue

        def lazy_initialization(key_states, value_states, layer=layer, init=init):
            init(key_states, value_states)
            if layer.values.dtype != value_states.dtype:  # [B, heads, L, head_dim] or empty
                layer.values = layer.values.to(value_states.dtype)
                # a compiled decode step needs the static tensors' addresses fixed, as
                # transformers marks its own
                if isinstance(layer, StaticLayer) and not torch.compiler.is_compiling():
                    torch._dynamo.mark_static_address(layer.values)

        layer.lazy_initialization = lazy_initialization


def full_attention_layers(cache) -> str | None:
    """Why the prompts' keys and values cannot be copied into this static cache (a layer that is
    not a plain StaticLayer: a sliding window keeps its own positions), or None."""
    from transformers.cache_utils import StaticLayer

    odd = sorted({type(layer).__name__ for layer in cache.layers
                  if type(layer) is not StaticLayer})
    return f"the static cache has {', '.join(odd)} layers" if odd else None


def fill_from(cache, prefilled) -> None:
    """Writes a prefilled DynamicCache's keys and values ([B, heads, Lp - 1, head_dim] per
    layer, `generation._prefilled_cache`) into the empty static cache's first positions."""
    for i, layer in enumerate(prefilled.layers):
        cache.update(layer.keys, layer.values, i)
