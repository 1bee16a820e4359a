"""grpo_train.generation's path rule and the static-cache path: "auto" takes the first path of
the device's rule that runs (GENERATION_RULES) and the log line names the rule and each refusal
(--bf16's among them), whichever call comes first; the static cache,
uncompiled and compiled (slow: torch.compile on a CPU takes ~40 s), gives `model.generate`'s
greedy tokens on the embedded model and random Qwen2 and Llama models, its prompts prefilled
once, its cache kept across calls of one shape, and it falls back to padded, saying why."""

from __future__ import annotations

import pytest
import torch

from grpo_train import generation, length_forcing, static_decode
from grpo_train.config import TrainConfig, resolve_auto
from grpo_train.models import build_embedded, prepare_tokenizer
from tests.train.test_generation import EXAMPLES, ONCE, VARIED, assert_same_batch, make_ctx

STATIC = "generation: static cache, decode not compiled (--no_static_compile)"


@pytest.fixture(scope="module")
def tiny():
    """The embedded model and a random Qwen2 and Llama (std 0.2: completions depend on the
    prompt), 12 new tokens, G = 3."""
    from grpo_train.tiny import build_tiny_model

    torch.set_num_threads(1)
    cfg = resolve_auto(TrainConfig(tiny_hidden_size=32, tiny_layers=1, max_new_tokens=12,
                                   num_generations=3))
    model, tok = build_embedded(cfg)
    models = {"embedded": model.eval()}
    for arch in ("qwen2", "llama"):
        models[arch] = build_tiny_model(tok, arch=arch, hidden_size=64, num_layers=2,
                                        initializer_range=0.2).eval()
        prepare_tokenizer(tok, models[arch])
    return models, tok, cfg


def reference(model, tok, examples, G, max_new):
    """`model.generate` (greedy, its own dynamic cache, every row prefilled) on the left-padded
    prompts, each G times: [B, max_new] completion tokens."""
    from grpo_train.models import encode_prompts, render_prompts

    ids, mask = encode_prompts(tok, render_prompts(tok, examples, None), None, "cpu")
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return out[:, ids.shape[1]:]


def static_batch(model, tok, cfg, greedy, compiled=False, log=None, **fields):
    ctx = make_ctx(model, tok, cfg, "static", log, static_compile=compiled,
                   min_new_tokens=cfg.max_new_tokens, **fields)
    torch.manual_seed(0)
    return generation.generate(model, VARIED, ctx, greedy=greedy), ctx


@pytest.mark.parametrize("name", ["embedded", "qwen2", "llama"])
def test_static_cache_gives_generates_greedy_tokens(tiny, name):
    """G = 1 (greedy) and G = 3 (top_k = 1: greedy, each prompt prefilled once into the static
    cache): the tokens `model.generate` gives with its own cache."""
    models, tok, cfg = tiny
    model = models[name]
    for greedy, G, fields in ((True, 1, {}), (False, cfg.num_generations, dict(top_k=1))):
        log = []
        batch, ctx = static_batch(model, tok, cfg, greedy, log=log, **fields)
        want = reference(model, tok, VARIED, G, cfg.max_new_tokens)
        assert torch.equal(batch["input_ids"][:, -batch["T"]:], want), (name, G)
        assert log == [f"{STATIC} (--generation static); {ONCE}"]
    assert len({tuple(r) for r in want.tolist()}) > 2 or name == "embedded"  # prompt-dependent


@pytest.mark.slow
def test_compiled_decode_gives_generates_greedy_tokens(tiny):
    """torch.compile of the decode step (on a CPU: forced on, inductor's default mode; ~40 s,
    then ~20 s for the second batch shape): the same tokens, cached for the next call."""
    models, tok, cfg = tiny
    model = models["qwen2"]
    log = []
    ctx = make_ctx(model, tok, cfg, "static", log, static_compile=True,
                   min_new_tokens=cfg.max_new_tokens, top_k=1)
    for _ in range(2):  # the second call replays what the first compiled
        torch.manual_seed(0)
        batch = generation.generate(model, VARIED, ctx)
        want = reference(model, tok, VARIED, cfg.num_generations, cfg.max_new_tokens)
        assert torch.equal(batch["input_ids"][:, -batch["T"]:], want)
    assert log == ["generation: static cache, decode compiled (torch.compile on cpu) "
                   f"(--generation static); {ONCE}"]
    assert len(ctx.static_caches) == 1


def test_static_cache_is_kept_per_shape_and_reset(tiny, monkeypatch):
    models, tok, cfg = tiny
    model = models["qwen2"]
    _, ctx = static_batch(model, tok, cfg, False, top_k=1)
    (key, cache), = ctx.static_caches.items()
    B, length, _ = key
    assert B == len(VARIED) * cfg.num_generations and length % static_decode.LENGTH_STEP == 0
    assert length >= max(len(ex["prompt"]) for ex in VARIED) + 1 + cfg.max_new_tokens
    torch.manual_seed(0)
    again = generation.generate(model, VARIED, ctx)
    assert ctx.static_caches[key] is cache  # the same tensors: a compiled graph stays valid
    generation.generate(model, VARIED, ctx, greedy=True)  # another batch: another cache
    assert len(ctx.static_caches) == 2
    monkeypatch.setattr(static_decode, "KEPT_CACHES", 1)
    generation.generate(model, VARIED, ctx)
    assert list(ctx.static_caches) == [key]  # the oldest went
    assert again["T"] == cfg.max_new_tokens


def test_forced_lengths_on_the_static_path(tiny):
    models, tok, cfg = tiny
    B = len(EXAMPLES) * cfg.num_generations
    lengths = [1 + (i * 5) % (cfg.max_new_tokens + 1) for i in range(B)]
    with length_forcing.forced_lengths(lambda n: lengths):
        ctx = make_ctx(models["qwen2"], tok, cfg, "static", static_compile=False)
        batch = generation.generate(models["qwen2"], EXAMPLES, ctx)
    assert batch["lengths"].tolist() == [min(n, cfg.max_new_tokens) for n in lengths]


def test_static_path_under_bf16_autocast(tiny):
    """--bf16 (float32 weights, bf16 autocast): the keys leave the rotary embedding in float32,
    the values stay bf16; the static path runs (no fall back to padded) and its cache holds each
    in its own dtype."""
    models, tok, cfg = tiny
    model = models["qwen2"]
    log = []
    ctx = make_ctx(model, tok, cfg, "static", log, static_compile=False, bf16=True, top_k=1)
    ctx.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    torch.manual_seed(0)
    batch = generation.generate(model, VARIED, ctx)
    assert log == [f"{STATIC} (--generation static); {ONCE}"]
    (cache,) = ctx.static_caches.values()
    assert {(layer.keys.dtype, layer.values.dtype) for layer in cache.layers} == {
        (torch.float32, torch.bfloat16)}
    assert batch["T"] == cfg.max_new_tokens


def test_values_keep_their_dtype_where_a_layer_takes_the_keys_dtype():
    """A cache layer that allocates its values in the keys' dtype (transformers before 5.24):
    the values get the dtype of the values written, in the static and the dynamic layer."""
    from transformers import DynamicCache, StaticCache
    from transformers.models.qwen2 import Qwen2Config

    config = Qwen2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                         num_hidden_layers=1)
    keys = torch.randn(2, 1, 3, 8)  # [B, heads, L, head_dim], float32
    values = keys.to(torch.bfloat16)
    for cache in (StaticCache(config=config, max_cache_len=8), DynamicCache(config=config)):
        layer = cache.layers[0]

        def keys_dtype_only(key_states, value_states, layer=layer,
                            init=layer.lazy_initialization):
            init(key_states, key_states)  # as transformers 5.17 allocates them
            layer.values = layer.values.to(key_states.dtype)

        layer.lazy_initialization = keys_dtype_only
        static_decode.values_keep_their_dtype(cache)
        k, v = cache.update(keys, values, 0)
        assert (k.dtype, v.dtype) == (torch.float32, torch.bfloat16), type(cache).__name__
        assert torch.equal(v[:, :, :3], values)


def test_static_refusals_and_failure_fall_back_to_padded(tiny, monkeypatch):
    models, tok, cfg = tiny
    model = models["qwen2"]
    want, _ = static_batch(model, tok, cfg, True)
    log = []
    with monkeypatch.context() as m:
        m.setattr(model.generation_config, "cache_implementation", "static")
        ctx = make_ctx(model, tok, cfg, "static", log, static_compile=False)
        generation.generate(model, VARIED, ctx, greedy=True)
    assert log == ["generation: padded (static: the generation config asks for a 'static' "
                   "cache); prefill per row: the generation config asks for a 'static' cache"]
    original = type(model).generate

    def no_static(self, *args, **kwargs):
        if isinstance(kwargs.get("cache"), torch.nn.Module) or "disable_compile" in kwargs:
            raise RuntimeError("inductor is missing a compiler")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", no_static)
    log = []
    torch.manual_seed(0)
    ctx = make_ctx(model, tok, cfg, "static", log, static_compile=False,
                   min_new_tokens=cfg.max_new_tokens)
    assert_same_batch(generation.generate(model, VARIED, ctx, greedy=True), want)
    assert log == [f"{STATIC} (--generation static); {ONCE}",
                   "generation: padded (static cache failed: RuntimeError: inductor is missing a "
                   f"compiler); {ONCE}"]
    assert ctx.generation_path == "padded" and not ctx.static_caches


def test_auto_takes_the_first_path_of_the_rule_that_runs(tiny, monkeypatch):
    """A rule preferring continuous batching, then static, under --fsdp (which neither serves):
    padded, and the line names the rule and both refusals; the CPU rule as built: padded."""
    models, tok, cfg = tiny
    model = models["embedded"]
    from grpo_train.checks import CHOICES

    assert CHOICES["generation"] == ("auto", *generation.PATHS)
    assert all(set(r.prefer) <= set(generation.PATHS) and r.source
               for r in generation.GENERATION_RULES.values())
    assert generation.GENERATION_RULES["cpu"].prefer == ("padded",)
    assert generation.GENERATION_RULES["cuda"].prefer == ("static", "padded")
    assert not generation.GENERATION_RULES["cuda"].placeholder  # measured on an H200
    monkeypatch.setitem(generation.GENERATION_RULES, "cpu", generation.GenerationRule(
        ("continuous", "static"), "test", placeholder=True))
    log = []
    generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, "auto", log, fsdp=True))
    assert log == ["generation: padded (auto, rule cpu: continuous, static (placeholder until "
                   "measured here); --fsdp: continuous batching needs the full parameters in "
                   "one process; static: --fsdp: a compiled decode of sharded parameters is "
                   f"untested here); {ONCE}"]
    log = []
    generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, "auto", log))
    generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, "auto", log))
    assert log == ["generation: continuous batching (sdpa; auto, rule cpu: continuous, static "
                   "(placeholder until measured here))"] * 2  # one per run state


def test_cuda_rule_compiles_the_decode_only_where_it_pays_back(tiny, monkeypatch):
    """The CUDA rule as built (static, then padded), here on the CPU: a run of too few decode
    steps (steps x max_new_tokens) to repay the compile takes padded, its line saying why;
    --bf16 (the README's real-model example) is no reason to leave the static path; without
    the compile the static path runs at any length."""
    models, tok, cfg = tiny
    model = models["embedded"]
    monkeypatch.setitem(generation.GENERATION_RULES, "cpu", generation.GENERATION_RULES["cuda"])
    rule = "auto, rule cpu: static, padded (measured)"
    log = []
    generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, "auto", log, bf16=True,
                                                  steps=10))
    assert log == [f"generation: padded ({rule}; static: 10 steps x 12 new tokens = 120 decode "
                   "steps, fewer than the 4,608 that repay compiling the decode step); "
                   f"{ONCE}"]
    steps = -(-static_decode.AUTO_MIN_DECODE_STEPS // cfg.max_new_tokens)
    ctx = make_ctx(model, tok, cfg, "auto", None, steps=steps)
    assert generation._refusal("static", model, ctx.cfg, {}) is None  # enough steps: compiled
    tp = make_ctx(model, tok, cfg, "auto", None, steps=steps, tp_size=2).cfg
    assert generation._refusal("static", model, tp, {}) == (
        "--tp_size: a static cache of tensor-parallel layers is untested here")
    log = []
    generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, "auto", log, bf16=True,
                                                  steps=10, static_compile=False))
    assert log == [f"{STATIC} ({rule}); {ONCE}"]


def test_a_greedy_first_call_decides_the_path_for_the_sampled_calls(tiny, monkeypatch):
    """A run's first call is the held-out evaluation's greedy one: continuous batching is
    refused for a sampling processor of the model's generation config (min_p: no
    continuous-batching form) all the same, as when a sampled call comes first."""
    models, tok, cfg = tiny
    model = models["embedded"]
    monkeypatch.setattr(model.generation_config, "min_p", 0.5)
    want = ["generation: padded (MinPLogitsWarper (from the generation config) has no "
            f"continuous-batching form); {ONCE}"]
    for first_greedy in (False, True):
        log = []
        ctx = make_ctx(model, tok, cfg, "continuous", log)
        generation.generate(model, EXAMPLES, ctx, greedy=first_greedy)
        generation.generate(model, EXAMPLES, ctx)
        assert log == want, first_greedy
