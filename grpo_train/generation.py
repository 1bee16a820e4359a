"""Generation: G sampled completions per prompt (and one greedy completion per prompt for the
held-out evaluation), with EOS handling and the completion mask.

`generate` returns the batch the rest of a step works on (see its docstring for the keys):
prompt + completion token ids [B, Lp + T] with prompts left-padded and completions right-padded,
and the [B, T] completion mask (1 up to and including the first EOS).

Three paths give the same batch (--generation): "padded" = `model.generate` on the left-padded
batch, which computes every row until the longest completion ends; "continuous" = transformers'
continuous batching (`continuous.py`), where a finished sequence stops costing anything;
"static" = `model.generate` with a static cache and, with --static_compile, its decode step
compiled (`static_decode.py`; CUDA graphs on a GPU). "auto" takes the first path that runs of
`GENERATION_RULES[device kind]`, a table set from measurements on that kind of device (an entry
not yet measured there says so). The path that ran, and why, is logged once.

All of them compute each prompt's prefill once for its G completions: continuous batching forks
the prompt's cache; the padded and static paths run the P distinct prompts once and repeat their
KV cache G times (`_prefill_refusal`: where it applies, and why not elsewhere). Benchmarks can
force completion lengths on any path (`forced_lengths`, `length_forcing.py`).

What generation reads comes from the trainer's run state (`run_state.RunState`): cfg, tokenizer,
eos_ids, autocast, say, and accel for `evaluate`; the path chosen on the first call is kept
there too (with the static path's caches). Direct calls pass a `GenerationSetup` holding the
same (benchmarks/generation.py).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_kernels.hf.unwrap import text_config

from . import continuous, sharding, static_decode
from .length_forcing import EosSchedule, lengths_to_force
from .models import completion_mask, encode_prompts, position_ids, render_prompts
from .rewards import accuracy


@dataclass(frozen=True)
class GenerationRule:
    """prefer: paths in order ("auto" runs the first this run allows, padded as the last
    resort); source: the measurement that set the order; placeholder: True while none was taken
    on this kind of device (the order is then today's default)."""

    prefer: tuple[str, ...]
    source: str
    placeholder: bool = False


PATHS = ("continuous", "padded", "static")  # --generation's, besides "auto"
GENERATION_RULES = {  # device kind -> rule (docs/trainer.md, Generation paths)
    "cpu": GenerationRule(
        ("padded",), "2-core AMD EPYC, python -m benchmarks.generation: at the default run's "
        "shape padded 4,989-10,519 tokens/s, continuous 1,909-2,582; continuous batching wins "
        "only for long completions of varied length"),
    "cuda": GenerationRule(
        ("static", "padded"), "H200, python -m benchmarks.generation --workloads trainer-64 "
        "(Qwen2.5-0.5B shape, bf16 weights, G = 8, lognormal lengths, cap 1,024): static with "
        "the decode compiled 3.70 s, padded 18.05 s, a prefill per row (TRL's call) 20.80 s; "
        "continuous batching did not run there (transformers 5.17)"),
}


@dataclass
class GenerationSetup:
    """What `generate` reads besides the model and the prompts, for a caller without a run
    state (benchmarks, tests); the trainer's `run_state.RunState` has the same fields."""

    cfg: Any  # the TrainConfig: generation path, G, sampling, max/min new tokens
    tokenizer: Any
    eos_ids: list[int]  # token ids that end a completion; eos_ids[0] ends a forced one
    autocast: Any = field(default_factory=contextlib.nullcontext)  # a context manager
    say: Callable[[str], None] | None = None  # one log line (None: print)
    forced_lengths: Callable[[int], list[int]] | None = None  # see `forced_lengths`
    generation_path: str | None = None  # one of PATHS, decided on the first call and kept
    generation_reason: str = ""  # why that path (the log line's parenthesis)
    continuous_logged: bool = False  # whether the continuous path's log line was printed
    prefill_once: bool | None = None  # the padded/static paths' prefill, decided with the path
    # and kept (False beforehand: every row prefills its own prompt, as benchmarks compare)
    static_caches: dict = field(default_factory=dict)  # the static path's caches, by shape
    decode_compile: tuple | None = None  # the static path's (generate keywords, log phrase)


def _say(run, msg: str) -> None:
    (run.say or print)(msg)


def _path(model, run, sampling: dict) -> str:
    """The path, decided on the first call and kept in `run.generation_path`: the asked one or
    the device rule's first that runs here, else padded (its line logged now; continuous
    batching's after its first call). sampling: the run's sampled calls' settings, whichever
    call comes first (a run's first is the held-out evaluation's greedy one, whose settings
    would hide the sampling processors continuous batching may lack)."""
    if run.generation_path is None:
        cfg = run.cfg
        kind = next(model.parameters()).device.type
        if cfg.generation == "auto":
            rule = GENERATION_RULES.get(kind) or GenerationRule(
                ("padded",), f"no rule for {kind}", placeholder=True)
            tag = "placeholder until measured here" if rule.placeholder else "measured"
            wanted, why = rule.prefer, f"auto, rule {kind}: {', '.join(rule.prefer)} ({tag})"
        else:
            wanted, why = (cfg.generation,), f"--generation {cfg.generation}"
        refusals = []
        for path in (*wanted, "padded"):
            refusal = _refusal(path, model, cfg, sampling)
            if refusal is None:
                break
            refusals.append(refusal if path == "continuous" else f"{path}: {refusal}")
        if refusals:  # an asked path that cannot run: only why not
            why = "; ".join(refusals if cfg.generation != "auto" else [why, *refusals])
        run.generation_path, run.generation_reason = path, why
        if path != "continuous":
            _take_path(model, run, path, why)
    return run.generation_path


def _refusal(path: str, model, cfg, sampling: dict) -> str | None:
    """Why `path` cannot serve this run (None: it can; padded always can)."""
    if path == "padded":
        return None
    if path == "static":
        return static_decode.unsupported_reason(model, cfg, auto=cfg.generation == "auto")
    return continuous.unsupported_reason(model, cfg, sampling)


def _take_path(model, run, path: str, reason: str) -> None:
    """The padded or static path from now on (kept in `run.generation_path`): decide its prefill
    (kept in `run.prefill_once`) and log the one line that names the path, why, and how the
    prompts are prefilled."""
    refusal = _prefill_refusal(model, run)
    name = "padded"
    if path == "static":
        run.decode_compile = static_decode.compile_settings(model, run.cfg)
        name = f"static cache, {run.decode_compile[1]}"
        if refusal is None:
            from transformers import StaticCache

            hf = continuous.base_model(model)
            refusal = static_decode.full_attention_layers(StaticCache(
                config=hf.config.get_text_config(decoder=True), max_cache_len=1))
    run.generation_path = path
    run.prefill_once = refusal is None
    how = "each prompt prefilled once" if refusal is None else f"prefill per row: {refusal}"
    _say(run, f"generation: {name} ({reason}); {how}")


def _prefill_refusal(model, run) -> str | None:
    """Why the padded path cannot prefill each prompt once and repeat its KV cache G times, or
    None. It needs transformers' DynamicCache with layers that repeat exactly (full or sliding
    attention: keys and values only; a linear-attention state would not be repeated), a decoder
    whose forward takes the cache and position ids, and no other cache asked for."""
    if run.prefill_once is False:
        return "turned off"
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError as err:
        return f"this transformers has no DynamicCache layers ({err})"
    hf = continuous.base_model(model)
    name = type(hf).__name__
    reason = continuous.own_cache_reason(hf)
    if reason is not None:
        return reason
    params = inspect.signature(hf.forward).parameters
    if _cache_kwarg(hf) is None or "position_ids" not in params:
        return f"{name}'s forward takes no cache or no position_ids"
    cache = _new_cache(hf, DynamicCache)
    kinds = ({type(layer) for layer in getattr(cache, "layers", ())}
             or {getattr(cache, "layer_class_to_replicate", None)})
    odd = kinds - {DynamicLayer, DynamicSlidingWindowLayer}
    if odd:
        names = sorted(getattr(k, "__name__", str(k)) for k in odd)
        return f"{name}'s cache has {', '.join(names)} layers"
    return None


def _cache_kwarg(hf) -> str | None:
    """The name the model's forward (and generate) take a cache by: "cache" from transformers
    5.24 on, "past_key_values" before (5.24 still accepts it, with a deprecation warning)."""
    params = inspect.signature(hf.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def _new_cache(hf, cache_class):
    """An empty cache built as `generate` builds its own (per-layer kinds from the config)."""
    if "config" in inspect.signature(cache_class).parameters:
        return cache_class(config=hf.config.get_text_config(decoder=True))
    return cache_class()


def _prefilled_cache(model, prompt_ids, prompt_mask, G: int):
    """The KV cache of the P distinct prompts' first Lp - 1 tokens, computed once ([P, Lp - 1]
    left-padded, positions counted over real tokens as `generate` counts them) and repeated G
    times along the batch: [P·G, heads, Lp - 1, head_dim] per layer, row j·G + g = prompt j.
    `generate` then runs the last prompt token of every row on it: it takes the cache to cover
    all but the last input token, whose logits give the first completion token."""
    from transformers import DynamicCache

    hf = continuous.base_model(model)
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # [P, Lp - 1]
    cache = _new_cache(hf, DynamicCache)
    static_decode.values_keep_their_dtype(cache)  # --bf16: bf16 values beside float32 keys
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(
        hf.forward).parameters else {}  # the logits are not used: skip [P, Lp - 1, V]
    hf(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True,
       **{_cache_kwarg(hf): cache}, **extra)
    cache.batch_repeat_interleave(G)
    return cache


@contextlib.contextmanager
def _router_logits_off(model):
    """A Mixture-of-Experts config saved with `output_router_logits: true` makes every forward
    add the auxiliary loss over the attention mask it is given; in a decode step that mask is
    [B, cache + 1] while the router logits cover the new token only, and the loss fails (a shape
    error) whenever a prompt is padded. Generation needs no router logits: turned off in the
    config for the call, so that every path (continuous batching's engine takes no keyword from
    here) and the prompt prefill run without them."""
    config = continuous.base_model(model).config
    text = text_config(config)
    asking = [c for c in {id(c): c for c in (config, text)}.values()
              if getattr(c, "output_router_logits", False)]
    for c in asking:
        c.output_router_logits = False
    try:
        yield
    finally:
        for c in asking:
            c.output_router_logits = True


@torch.no_grad()
def generate(model, examples: list[dict], run, greedy: bool = False) -> dict:
    """G sampled completions per prompt (1 greedy one with greedy=True), with EOS handling.
    run: the `RunState`, or a `GenerationSetup` (cfg, tokenizer, eos_ids, autocast, say)."""
    cfg, tok = run.cfg, run.tokenizer
    G = 1 if greedy else cfg.num_generations
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(
        tok, render_prompts(tok, examples, cfg.system_prompt), cfg.max_prompt_length, device)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]  # unpadded
    prompt_ids = prompt_ids.repeat_interleave(G, dim=0)  # [B, Lp], groups contiguous
    prompt_mask = prompt_mask.repeat_interleave(G, dim=0)
    B = prompt_ids.shape[0]
    lengths = lengths_to_force(run, B, cfg.max_new_tokens)
    sampled = dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    sampling = dict(do_sample=False) if greedy else sampled
    was_training = model.training
    model.eval()
    completion_ids = None  # [B, T], right-padded with pad_token_id
    try:
        # FSDP: gathered once per call
        with sharding.full_parameters(model), run.autocast, _router_logits_off(model):
            if _path(model, run, sampled) == "continuous":
                completion_ids = _continuous(model, prompts, G, sampling, lengths, run, device)
            if completion_ids is None:  # padded or static (or continuous batching failed)
                completion_ids = _padded(model, prompt_ids, prompt_mask, G, sampling, lengths,
                                         run)
    finally:
        model.train(was_training)
    return _batch(examples, run, G, prompt_ids, prompt_mask, completion_ids)


def _continuous(model, prompts, G, sampling, lengths, run, device) -> torch.Tensor | None:
    """[B, T] completion ids from continuous batching; None (logged, and the padded path for
    the rest of the run) if it failed."""
    cfg, tok = run.cfg, run.tokenizer
    try:
        rows, attn = continuous.generate(
            model, prompts, G, sampling, cfg.max_new_tokens, cfg.min_new_tokens, run.eos_ids,
            tok.pad_token_id, lengths)
    except Exception as err:  # noqa: BLE001 - any failure of the engine: fall back, say why
        _take_path(model, run, "padded",
                   f"continuous batching failed: {type(err).__name__}: {err}")
        return None
    if not run.continuous_logged:
        run.continuous_logged = True
        why = "" if cfg.generation == "continuous" else f"; {run.generation_reason}"
        _say(run, f"generation: continuous batching ({attn}{why})")
    T = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def _padded(model, prompt_ids, prompt_mask, G, sampling, lengths, run) -> torch.Tensor:
    """[B, T] completion ids from `model.generate` on the [B, Lp] left-padded prompts (each
    prompt G times), its prefill computed once per prompt where `run.prefill_once`; on the
    static path into the kept static cache, with the decode step compiled as decided."""
    cfg, tok = run.cfg, run.tokenizer
    B, Lp = prompt_ids.shape
    hf = continuous.base_model(model)
    extra = {}
    if lengths is not None:
        extra["logits_processor"] = [EosSchedule(torch.tensor(lengths), run.eos_ids, Lp)]
    cache = None
    if run.prefill_once and G > 1 and Lp > 1:  # G = 1: nothing to share
        # rows j·G .. j·G + G - 1 hold prompt j: [::G] is each prompt once, [P, Lp]
        cache = _prefilled_cache(model, prompt_ids[::G], prompt_mask[::G], G)
    if run.generation_path == "static":
        static = static_decode.static_cache(
            model, run, B, static_decode.cache_length(Lp, cfg.max_new_tokens))
        if cache is not None:
            static_decode.fill_from(static, cache)
        cache = static
        extra.update(run.decode_compile[0])
    if cache is not None:
        extra[_cache_kwarg(hf)] = cache
    try:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             max_new_tokens=cfg.max_new_tokens,
                             min_new_tokens=cfg.min_new_tokens, eos_token_id=run.eos_ids,
                             pad_token_id=tok.pad_token_id, use_cache=True, **sampling, **extra)
    except Exception as err:  # noqa: BLE001 - the static path (a compile): fall back, say why
        if run.generation_path != "static":
            raise
        run.static_caches.clear()
        run.prefill_once = None  # decided again for the padded path (the static cache's
        # own refusal, a sliding-window layer, does not hold there)
        _take_path(model, run, "padded", f"static cache failed: {type(err).__name__}: {err}")
        return _padded(model, prompt_ids, prompt_mask, G, sampling, lengths, run)
    completion_ids = out[:, Lp:]  # [B, T]
    if completion_ids.shape[1] == 0:  # nothing generated at all: keep one masked column
        completion_ids = torch.full((out.shape[0], 1), tok.pad_token_id, device=out.device)
    return completion_ids


def _batch(examples, run, G, prompt_ids, prompt_mask, completion_ids) -> dict:
    """The step's batch from [B, Lp] prompts and [B, T] completions (either path)."""
    cfg, tok = run.cfg, run.tokenizer
    device = completion_ids.device
    comp_mask = completion_mask(completion_ids, run.eos_ids)  # [B, T]
    lengths = comp_mask.sum(dim=1)
    is_eos = torch.isin(completion_ids, torch.tensor(run.eos_ids, device=device))
    truncated = ~is_eos.any(dim=1)
    if cfg.mask_truncated_completions:
        comp_mask = comp_mask * (~truncated).unsqueeze(1).long()
    texts = tok.batch_decode([c[:n] for c, n in zip(completion_ids.tolist(), lengths.tolist())],
                             skip_special_tokens=True)
    columns = {k: [ex.get(k) for ex in examples for _ in range(G)]
               for k in examples[0] if k != "prompt"}
    columns["completion_ids"] = [c[:n] for c, n in zip(completion_ids.tolist(), lengths.tolist())]
    return dict(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),  # [B, Lp + T]
        attention_mask=torch.cat([prompt_mask, comp_mask], dim=1),
        completion_mask=comp_mask, T=completion_ids.shape[1], texts=texts,
        prompts=[ex["prompt"] for ex in examples for _ in range(G)], columns=columns,
        lengths=lengths, truncated=truncated, prompt_tokens=prompt_mask.sum(),
    )


@torch.no_grad()
def evaluate(model, examples: list[dict], run) -> float:
    """Held-out accuracy: one greedy completion per prompt, scored by the built-in accuracy;
    the prompts are split over the processes and the counts summed. run: the `RunState`
    (accel as well as what `generate` reads)."""
    accel, cfg = run.accel, run.cfg
    mine = examples[run.rank::run.world]  # data-parallel: a tensor-parallel group's alike
    correct, total = 0.0, 0.0
    with sharding.full_parameters(model):  # FSDP: one gather, whatever each process' count
        for i in range(0, len(mine), cfg.eval_batch_size):
            chunk = mine[i:i + cfg.eval_batch_size]
            batch = generate(model, chunk, run, greedy=True)
            scores = accuracy(None, batch["texts"], answer=[ex["answer"] for ex in chunk])
            correct += sum(s for s in scores if s is not None)
            total += sum(s is not None for s in scores)
    counts = accel.reduce(torch.tensor([correct, total], device=accel.device), "sum")
    return (counts[0] / counts[1].clamp(min=1)).item()
