"""Continuous-batching generation: transformers' paged-attention manager (`generate_batch`'s
engine) with the trainer's sampling semantics.

A finished sequence leaves the batch at once and costs nothing more, where the padded path
(`generation.py`) keeps computing every row until the longest one ends. Each step packs the live
requests into one row of tokens; with sdpa or eager attention, that row's queries are scored
against the keys of *every* request in it (then masked), so an attention step costs
O(requests x all cached tokens) instead of the padded O(requests x one sequence's tokens). Only
flash attention's varlen kernels avoid that. On CPU this engine wins only for long completions
of varied length (docs/trainer.md, Generation paths), which is why `auto` runs padded there.

What is driven here rather than through `generate_batch`, and why:
  - every request is queued before the manager's thread starts, so the first batch holds all of
    them and the schedule (hence the order random numbers are drawn in) is the same on every run;
  - the sampling seed is drawn from torch's global generator and the manager's own reseeding of
    that generator is undone afterwards, so a seeded run is reproducible and the rest of the run
    sees one draw, as after the padded path;
  - `min_new_tokens` and forced completion lengths go through `EosControl`, a per-request
    processor: transformers drops its MinNewTokens processor in continuous batching (it counts
    tokens from a [B, L] input_ids, and continuous batching passes one token per request);
  - the G completions of a prompt are one request with G - 1 forked children (the prompt is
    prefilled once), returned in a fixed order: children 0..G-2, then the parent.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import warnings

import torch

PAGE_SIZE = 32  # tokens per cache page: short completions waste little of their last page
MAX_BATCH_TOKENS = 2048  # query tokens per forward; longer prefills are split over forwards
FREE, NO_EOS, ONLY_EOS = 0, 1, 2  # EosControl's per-request codes
# ContinuousBatchingConfig fields cache_config must set (page size aside): without any of them
# the cache, the schedule or the seed would be transformers' defaults, not this path's
NEEDED_FIELDS = ("num_blocks", "max_requests_per_batch", "max_batch_tokens", "seed",
                 "allow_block_sharing")


def processor_classes():
    """(ContinuousBatchingLogitsProcessor, ContinuousBatchingLogitsProcessorList); ImportError
    when this transformers has no continuous batching."""
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )

    return ContinuousBatchingLogitsProcessor, ContinuousBatchingLogitsProcessorList


def base_model(model):
    """The transformers model under a PEFT wrapper (the LoRA layers live inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def own_cache_reason(hf) -> str | None:
    """Why the decoder `hf` (a `base_model`) cannot take a cache the generation path builds
    (an encoder-decoder, a model with a cache of its own, a generation config that asks for
    another cache), or None."""
    name = type(hf).__name__
    if getattr(hf.config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder"
    supports = getattr(hf, "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return f"{name} keeps its own cache, not transformers' Cache"
    implementation = getattr(hf.generation_config, "cache_implementation", None)
    if implementation is not None:
        return f"the generation config asks for a {implementation!r} cache"
    return None


def generation_config(model, sampling: dict, max_new_tokens: int, eos_ids: list[int], pad_id,
                      num_return_sequences: int = 1):
    """The model's generation config updated with this call's settings, as `model.generate`
    builds its own; min_new_tokens is left to `EosControl` (see the module docstring)."""
    gen = copy.deepcopy(base_model(model).generation_config)
    gen.update(**sampling, max_new_tokens=max_new_tokens, min_new_tokens=None, min_length=0,
               eos_token_id=eos_ids, pad_token_id=pad_id,
               num_return_sequences=num_return_sequences)
    return gen


def unsupported_reason(model, cfg, sampling: dict) -> str | None:
    """Why continuous batching cannot give this run the padded path's semantics, or None."""
    import transformers

    try:
        processor_classes()
        from transformers import ContinuousBatchingConfig
    except ImportError as err:
        return f"transformers {transformers.__version__} has no continuous batching ({err})"
    try:  # the page field's name changed between releases (see config_kwargs)
        config_kwargs(ContinuousBatchingConfig, PAGE_SIZE)
    except TypeError as err:
        return f"transformers {transformers.__version__}: {err}"
    hf = base_model(model)
    if not hasattr(hf, "init_continuous_batching"):
        return f"{type(hf).__name__} has no init_continuous_batching"
    if cfg.fsdp:
        return "--fsdp: continuous batching needs the full parameters in one process"
    if getattr(cfg, "tp_size", 1) > 1:
        return "--tp_size: continuous batching is untested with tensor parallelism"
    if cfg.bf16:  # autocast is thread-local and the manager runs the model in its own thread
        return "--bf16 autocast does not reach continuous batching's generation thread"
    device = next(model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type} is untested with continuous batching"
    gen = generation_config(model, sampling, cfg.max_new_tokens, [0], 0)
    with warnings.catch_warnings():  # building the list warns as if generate() were called
        warnings.simplefilter("ignore")
        processors = hf._get_logits_processor(gen)
    for proc in processors:
        if getattr(proc, "supports_continuous_batching", None) is not True:
            return (f"{type(proc).__name__} (from the generation config) has no "
                    "continuous-batching form")
    return None


def make_eos_control(eos_ids: list[int], min_new_tokens: int, lengths: dict[str, int] | None):
    """An `EosControl` (defined here so that importing this module needs no transformers)."""
    base, _ = processor_classes()

    class EosControl(base):
        """Per request, at the completion index t of the token about to be sampled: EOS banned
        while t < min_new_tokens (or t < L - 1 with a forced length L), the only choice at
        t = L - 1. The code per request is an int32 tensor argument, as the manager expects."""

        supported_kwargs: dict = {}
        ignored_kwargs: tuple = ()

        def __init__(self):
            self.eos_ids, self.min_new, self.lengths = eos_ids, min_new_tokens, lengths
            self.eos_mask = self.only_eos = None  # [V] bool, [V] float: built on first call

        def fill_defaults(self, int32_tensor):
            int32_tensor.fill_(FREE)

        def prepare_tensor_args(self, requests_with_new_token):
            codes = []
            for future in requests_with_new_token:
                state = future.state
                # the prompt length (a request re-queued after offloading carries its generated
                # tokens in its prompt); position_offset already counts this step's query tokens
                prompt = getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens)
                t = state.position_offset - prompt
                L = None if self.lengths is None else self.lengths.get(state.request_id)
                if L is None:
                    codes.append(NO_EOS if t < self.min_new else FREE)
                else:
                    codes.append(ONLY_EOS if t == L - 1 else NO_EOS if t < L - 1 else FREE)
            return torch.tensor(codes, dtype=torch.int32)

        def __call__(self, scores, tensor_arg):  # scores [n, V], tensor_arg [>= n] int32
            if self.eos_mask is None:
                V = scores.shape[-1]
                self.eos_mask = torch.zeros(V, dtype=torch.bool, device=scores.device)
                self.eos_mask[self.eos_ids] = True
                self.only_eos = torch.full((V,), -math.inf, device=scores.device)
                self.only_eos[self.eos_ids[0]] = 0.0
            code = tensor_arg[: scores.shape[0]].unsqueeze(1)  # [n, 1]
            scores = scores.masked_fill((code == NO_EOS) & self.eos_mask, -math.inf)
            return torch.where(code == ONLY_EOS, self.only_eos.to(scores.dtype), scores)

    return EosControl()


def config_kwargs(config_cls, page_size: int, **values) -> dict:
    """Keyword arguments for `config_cls` (a ContinuousBatchingConfig dataclass): the tokens per
    cache page under the name the class gives them (`block_size` in transformers 5.17,
    `page_size` in 5.24), and `values`, each passed only where the class has its field. A
    TypeError names what is missing when the class lacks a page field or one of NEEDED_FIELDS."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    page_field = next((name for name in ("page_size", "block_size") if name in fields), None)
    missing = [name for name in NEEDED_FIELDS if name not in fields]
    if page_field is None:
        missing.insert(0, "page_size or block_size")
    if missing:
        raise TypeError(f"{config_cls.__name__} has no {', '.join(missing)}: the cache could not "
                        "be sized, nor the schedule and the seed fixed, as this path needs")
    return {page_field: page_size, **{k: v for k, v in values.items() if k in fields}}


def cache_config(prompt_lens: list[int], G: int, max_new_tokens: int, seed: int):
    """A ContinuousBatchingConfig sized for this call: cache pages for every sequence at full
    length (no offloading), instead of transformers' default of a share of free memory."""
    from transformers import ContinuousBatchingConfig

    B = len(prompt_lens) * G
    # + 1 page per group: room for the scheduler to place a fork before a finished one is freed
    pages = sum(G * math.ceil((n + max_new_tokens) / PAGE_SIZE) + 1 for n in prompt_lens)
    # the eager/sdpa attention mask is preallocated as [M, cache tokens + M] for M batch tokens:
    # enough for every prompt in one forward, capped
    M = min(max(sum(prompt_lens), B), MAX_BATCH_TOKENS)
    # disable_nccl_graph_mixing would set NCCL_GRAPH_MIXING_SUPPORT=0 in the environment of
    # every data-parallel process (a tensor-parallel setting; one process runs one engine here)
    return ContinuousBatchingConfig(**config_kwargs(
        ContinuousBatchingConfig, PAGE_SIZE, num_blocks=pages, max_requests_per_batch=B,
        max_batch_tokens=max(M, B), seed=seed, allow_block_sharing=False,
        disable_nccl_graph_mixing=False))


def generate(model, prompts: list[list[int]], G: int, sampling: dict, max_new_tokens: int,
             min_new_tokens: int, eos_ids: list[int], pad_id: int,
             lengths: list[int] | None = None) -> tuple[list[list[int]], str]:
    """G completions of each prompt (unpadded ids) as lists of ids, group by group in prompt
    order, each ending at its first EOS (included) or at max_new_tokens; and the attention
    implementation that ran. lengths: a forced completion length per sequence (B = P·G)."""
    from transformers.generation.continuous_batching.continuous_api import (
        BackgroundThreadStatus as thread_status,
    )

    hf = base_model(model)
    _, processor_list = processor_classes()
    gen = generation_config(model, sampling, max_new_tokens, eos_ids, pad_id, G)
    ids = [[f"p{j}__child#{k}" for k in range(G - 1)] + [f"p{j}"] for j in range(len(prompts))]
    forced = None if lengths is None else {
        rid: int(L) for rid, L in zip([r for group in ids for r in group], lengths)}
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # one draw from the caller's stream
    devices = [hf.device] if hf.device.type == "cuda" else []
    original_attn = hf.config._attn_implementation
    results: dict[str, object] = {}
    with torch.random.fork_rng(devices=devices):  # the manager reseeds the global generator
        manager = hf.init_continuous_batching(
            generation_config=gen,
            continuous_batching_config=cache_config([len(p) for p in prompts], G,
                                                    max_new_tokens, seed))
        try:
            # transformers 5.17 runs sdpa on the paged cache as "paged|sdpa", 5.24 as "sdpa": one
            # name for one kernel, as "paged|eager" is on both
            attn = hf.config._attn_implementation.replace("paged|sdpa", "sdpa")
            if forced is not None or min_new_tokens > 0:  # EOS control first, before warpers
                procs = [make_eos_control(eos_ids, min_new_tokens, forced),
                         *manager.logit_processor.logits_processor]
                manager.logit_processor = processor_list(procs)
                manager.logit_processor.tensors_required = 1  # the list counts only its own
            for j, prompt in enumerate(prompts):  # queued before the thread starts: see above
                manager.add_request(prompt, request_id=f"p{j}", max_new_tokens=max_new_tokens,
                                    eos_token_id=eos_ids)
            manager.start()
            # all requests are queued: the thread finishes them, then exits without waiting
            manager.background_thread_status.request_stop(thread_status.FLUSH_AND_STOP, 0)
            while len(results) < len(prompts) * G:
                out = manager.get_result(timeout=0.5)  # None: nothing yet, or the thread died
                if out is None:  # the thread may have delivered its last result and exited
                    if not manager.is_running() and manager.output_router.output_queue.empty():
                        raise RuntimeError("the generation thread stopped before finishing") \
                            from manager.background_thread_status.fatal_error
                    continue
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.is_finished():
                    results[out.request_id] = out
        finally:
            # stop() runs gc.collect() twice (once itself, once freeing the batch processor):
            # a full collection costs ~0.3 s in a trainer process of ~400k objects, so the
            # objects that exist before are frozen out of it (gc.freeze) for its duration
            gc.freeze()
            try:
                manager.stop(block=True, timeout=None)
                manager.destroy()
            finally:
                gc.unfreeze()
            if hf.config._attn_implementation != original_attn:
                hf.set_attn_implementation(original_attn)
    return [list(results[r].generated_tokens) for group in ids for r in group], attn
