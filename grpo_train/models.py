"""Loading the policy, its tokenizer and the reference model, and preparing them for training
(`build_models`: LoRA, the packed-row check, gradient checkpointing, FSDP sharding); prompt
encoding; the embedded model's format warm-up.

Sequences are laid out as [left-padded prompt | right-padded completion], the layout `generate`
returns, so the last T columns of every row are its completion.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import torch

from grpo_kernels import selective_logprobs
from grpo_kernels.hf import (
    AttentionChoice,
    RowLayout,
    choose_attention,
    choose_layout,
    completion_hidden_states,
    logit_transform,
    output_head,
)

from . import sharding, tensor_parallel
from .checks import check_model_source
from .data import random_answer_texts
from .flags import UsageError
from .hub import cache_only

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pretrained(source: str, cfg, flag: str = "--model"):
    """(model, tokenizer) from a local directory or a hub id, with errors that name `flag`.
    A hub id is read from the local cache when HF_HUB_OFFLINE=1 or the hub cannot be reached
    (a few seconds to find out), so a machine without network fails fast, with a way out."""
    check_model_source(source, flag)
    local = os.path.exists(source)
    kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    if not local:
        kwargs["local_files_only"] = cache_only(flag, source, cfg.revision)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[cfg.model_dtype],
                                                     **kwargs, **tensor_parallel.load_kwargs(cfg))
    except (OSError, ValueError, KeyError) as err:
        where = "local directory" if local else "hub id"
        if kwargs.get("local_files_only"):
            where = "hub id, local cache only"
        raise UsageError(f"{flag} {source!r} ({where}) could not be loaded as an "
                         f"AutoModelForCausalLM with its tokenizer: {err}") from err
    return model, prepare_tokenizer(tokenizer, model)


def use_fp32_head(model) -> None:
    """--fp32_lm_head: the output embedding's weight becomes float32 and a pre-hook casts its
    input up, so generation and the materialized-logits loss run it as TRL's
    cast_lm_head_to_fp32 does; the fused loss takes the 16-bit hidden states with the float32
    weight as they are."""
    head = model.get_output_embeddings()
    if head.weight.dtype == torch.float32:
        return
    emb = model.get_input_embeddings()
    if emb is not None and emb.weight is head.weight:
        raise UsageError("--fp32_lm_head: this model ties its output head to the input "
                         "embedding, which would be cast to float32 too; use "
                         "--model_dtype float32 with --bf16 (its head is float32 already)")
    head.float()
    head.register_forward_pre_hook(lambda _m, args: tuple(
        a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))


def add_lora_adapters(model, cfg, say=print):
    """--lora_r > 0: the PEFT model to train (LoRA on every linear layer, and on the output head
    with --lora_head)."""
    try:
        from grpo_kernels.hf.head_adapters import add_lora

        # the adapters' random init from --seed, not from whatever the process drew before
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha,
                             dropout=cfg.lora_dropout, head=cfg.lora_head)
    except ImportError as err:
        raise UsageError(f"--lora_r needs PEFT: pip install 'grpo-kernels[lora]' ({err})") \
            from err
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    say(f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha:g} on every linear layer"
        f"{' and the output head' if cfg.lora_head else ''}: {trainable:,} of {total:,} "
        "parameters train")
    return model


def build_models(cfg, out_dir: Path, train_ex, device, fresh: bool, accel, say, eval_ex=(),
                 before_write=None):
    """(policy, reference or None, tokenizer, EOS ids, micro-batch layout, the attention of the
    scoring and loss forwards) on `device`, sharded with --fsdp; the policy with LoRA adapters
    and gradient checkpointing if asked. The prompts of train_ex and eval_ex must fit the
    model's positions (`positions.check_positions`). before_write: called (if given) before
    anything is written to out_dir."""
    model, tokenizer = load_policy(cfg, out_dir, train_ex, device, fresh, accel, say, eval_ex,
                                   before_write)
    if cfg.fp32_lm_head:
        use_fp32_head(model)
    ref_model = None  # beta = 0 needs no reference at all
    if cfg.beta != 0.0 and not cfg.lora_r:  # the frozen initial policy
        ref_model = (_load_reference(cfg, out_dir) if cfg.tp_size > 1 else
                     copy.deepcopy(model)).eval().requires_grad_(False)
    if cfg.lora_r:  # adapters on the policy only: the reference is the model without them, so
        model = add_lora_adapters(model, cfg, say)  # no copy (trainer's `_reference_policy`)
    eos_ids = eos_token_ids(model, tokenizer)
    layout = micro_batch_layout(model, cfg, say)  # before any wrapper: checks the bare model
    attention = forward_attention(model, cfg, layout, device, say)
    if cfg.gradient_checkpointing:  # transformers >= 5.2x renamed the method
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    if cfg.fsdp:  # shard in place before the optimizer sees the parameters (see sharding.py)
        model = sharding.shard_model(model, device)
        if ref_model is not None:
            ref_model = sharding.shard_model(ref_model, device, frozen=True)
    return model, ref_model, tokenizer, eos_ids, layout, attention


# the row layouts an --attn_implementation runs (the others: any)
_LAYOUTS_OF = {"torch_varlen_flash": (RowLayout.PACKED,)}


def _load_reference(cfg, out_dir):
    """--tp_size: the initial policy loaded again with the plan (a deep copy would run the
    policy's tensor-parallel forwards, closures over its modules; `tensor_parallel`)."""
    source = cfg.model or str(Path(out_dir) / "initial_model")
    return load_pretrained(source, cfg, flag="--model" if cfg.model else "initial model")[0]


def micro_batch_layout(model, cfg, say) -> RowLayout:
    """How micro-batches are laid out (`grpo_kernels.hf.choose_layout`): "shared" (each group's
    prompt once, --share_prompt), "packed" (--padding_free) or "padded", as far as the flags
    ask, the model allows and an --attn_implementation asked for runs; one line says which and
    why. Checks the bare model, once."""
    share = cfg.padding_free and getattr(cfg, "share_prompt", False)
    asked = getattr(cfg, "attn_implementation", "auto")
    unshared = share and RowLayout.SHARED not in _LAYOUTS_OF.get(asked, (RowLayout.SHARED,))
    choice = choose_layout(model, padding_free=cfg.padding_free,
                           share_prompt=share and not unshared)
    reason = choice.reason
    if unshared and choice.layout is RowLayout.PACKED:
        reason = f"the prompt not shared: --attn_implementation {asked} takes no 4-D mask"
    padded = "--no_padding_free" if not cfg.padding_free else "--padding_free"
    flags = {RowLayout.PADDED: padded, RowLayout.PACKED: "--padding_free",
             RowLayout.SHARED: "--share_prompt"}[choice.layout]
    say(f"micro-batches: {choice.layout} rows, {reason} ({flags})")
    return choice.layout


def forward_attention(model, cfg, layout: RowLayout, device, say) -> AttentionChoice:
    """The attention implementation of the scoring and loss forwards
    (`grpo_kernels.hf.choose_attention`: the rule for this device and layout, or
    --attn_implementation), checked under the run's autocast; one line says which and why.
    A UsageError naming the flag where the asked implementation cannot run."""
    asked = getattr(cfg, "attn_implementation", "auto")
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.bf16)
    try:
        choice = choose_attention(model, layout, device, requested=asked, autocast=autocast)
    except ValueError as err:
        raise UsageError(f"--attn_implementation {asked}: {err}") from err
    why = f"asked for (--attn_implementation {asked})" if asked != "auto" else choice.reason
    say(f"attention: {choice.implementation} for the scoring and loss forwards of {layout} rows "
        f"on {choice.device_kind}, {why}")
    return choice


def save_model(model, tokenizer, path) -> None:
    """save_pretrained() of model and tokenizer, without transformers' progress bars in our log."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def prepare_tokenizer(tokenizer, model):
    """Left padding (generation appends on the right); a pad token if the model has none."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = model.generation_config
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    return tokenizer


def build_embedded(cfg):
    """The embedded default: a tiny random causal LM built from a transformers config."""
    from .tiny import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, arch=cfg.tiny_arch, hidden_size=cfg.tiny_hidden_size,
                             num_layers=cfg.tiny_layers, seed=cfg.seed,
                             initializer_range=cfg.tiny_init_std)
    return model.to(DTYPES[cfg.model_dtype]), prepare_tokenizer(tokenizer, model)


def load_policy(cfg, out_dir, train_ex, device, fresh: bool, accel, say, eval_ex=(),
                before_write=None):
    """(model, tokenizer): the policy at step 0, on `device`. The embedded model is built (and
    format-warmed-up) once, and saved to OUTPUT_DIR/initial_model so that a resumed run restarts
    from exactly the same weights (`fresh`: no checkpoint is resumed). The prompts' positions
    are checked before the warm-up, so that a refused run writes nothing."""
    from .positions import check_positions

    examples = [*train_ex, *eval_ex]
    if cfg.model:
        model, tokenizer = load_pretrained(cfg.model, cfg)
        check_positions(model, tokenizer, cfg, examples, say, render_prompts)
        return model.to(device), tokenizer
    initial = Path(out_dir) / "initial_model"
    if not fresh and initial.is_dir():
        model, tokenizer = load_pretrained(str(initial), cfg, flag="initial model")
        check_positions(model, tokenizer, cfg, examples, say, render_prompts)
        return model.to(device), tokenizer
    model, tokenizer = build_embedded(cfg)
    check_positions(model, tokenizer, cfg, examples, say, render_prompts)
    if before_write is not None:
        before_write()
    model.to(device)
    losses = format_warmup(model, tokenizer, train_ex, cfg, device)
    if losses:
        say(f"format warm-up: {len(losses)} supervised steps on random answers, loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f} (teaches digits-then-EOS, not the sums)")
    if accel.is_main_process:
        save_model(model, tokenizer, initial)
    accel.wait_for_everyone()
    if cfg.tp_size > 1:  # the warmed-up model, loaded with the plan (`tensor_parallel`)
        return load_pretrained(str(initial), cfg, flag="initial model")
    return model, tokenizer


def eos_token_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


# ---- prompts ------------------------------------------------------------------------------------


def render_prompts(tokenizer, examples: list[dict], system_prompt: str | None) -> list[str]:
    """Prompt texts: through the chat template when the tokenizer has one, else as they are."""
    texts = []
    for ex in examples:
        prompt = ex["prompt"]
        if getattr(tokenizer, "chat_template", None):
            messages = list(prompt) if isinstance(prompt, list) else [
                {"role": "user", "content": str(prompt)}]
            if system_prompt and messages[0].get("role") != "system":
                messages = [{"role": "system", "content": system_prompt}, *messages]
            texts.append(_apply_template(tokenizer, messages, system_prompt))
        else:
            if isinstance(prompt, list):
                prompt = "\n".join(m["content"] for m in prompt)
            texts.append(f"{system_prompt}\n\n{prompt}" if system_prompt else str(prompt))
    return texts


def _apply_template(tokenizer, messages: list[dict], system_prompt: str | None) -> str:
    """One prompt through the chat template; a template that refuses the messages (raises, as
    templates without a system role do for one) is a UsageError naming the roles."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as err:
        roles = ", ".join(str(m.get("role")) for m in messages)
        hint = (" --system_prompt adds a system message: leave it out and put the instruction "
                "in the prompts, if this template takes none." if system_prompt else "")
        raise UsageError(f"the tokenizer's chat template refused a prompt of the messages "
                         f"({roles}): {err}.{hint}") from err


def encode_prompts(tokenizer, texts: list[str], max_length: int | None, device):
    """Left-padded prompt ids and attention mask, both [P, Lp] int64."""
    templated = bool(getattr(tokenizer, "chat_template", None))  # the template adds specials
    enc = tokenizer(texts, add_special_tokens=not templated, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if max_length is not None and ids.shape[1] > max_length:
        ids, mask = ids[:, -max_length:], mask[:, -max_length:]
    return ids.to(device), mask.to(device)


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B, T] int64: 1 up to and including the first EOS, 0 after it (generate's padding)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return (~after_eos).long()


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens, as `generate` assigns them with left padding."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


# ---- the embedded model's format warm-up -------------------------------------------------------


def format_warmup(model, tokenizer, examples: list[dict], cfg, device, batch_size: int = 64):
    """Supervised steps on training prompts paired with *random* answers (drawn independently of
    the prompt): the model learns to emit a short number then EOS, which makes the accuracy reward
    reachable from a random init, and learns nothing about which number is right.
    Uses its own optimizer (discarded) and RNG, so the RL run starts from a fixed state."""
    if cfg.format_warmup_steps <= 0:
        return []
    answers = sorted({ex["answer"] for ex in examples if ex["answer"] is not None})
    if not answers:  # None + EOS was a TypeError in the first step
        raise UsageError(
            f"--format_warmup_steps {cfg.format_warmup_steps} trains the embedded model on the "
            f"training rows' answers, and --dataset {cfg.dataset!r} has none (--answer_column "
            f"{cfg.answer_column!r}): pass --format_warmup_steps 0, or name the answer column")
    rng = random.Random(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.format_warmup_lr, weight_decay=0.0)
    eos = tokenizer.eos_token
    losses = []
    model.train()
    for _ in range(cfg.format_warmup_steps):
        batch = [rng.choice(examples) for _ in range(batch_size)]
        targets = random_answer_texts(batch, rng, answers)  # rows without an answer: any
        prompt_ids, prompt_mask = encode_prompts(
            tokenizer, render_prompts(tokenizer, batch, cfg.system_prompt),
            cfg.max_prompt_length, device)
        tokenizer.padding_side = "right"  # completions are right-padded
        comp = tokenizer([a + eos for a in targets], add_special_tokens=False, padding=True,
                         return_tensors="pt")
        tokenizer.padding_side = "left"
        comp_ids, comp_mask = comp["input_ids"].to(device), comp["attention_mask"].to(device)
        ids = torch.cat([prompt_ids, comp_ids], dim=1)  # [b, Lp + T]
        attn = torch.cat([prompt_mask, comp_mask], dim=1)
        T = comp_ids.shape[1]
        hidden = completion_hidden_states(model, ids, attn, T, position_ids=position_ids(attn))
        weight, bias = output_head(model)
        logp = selective_logprobs(hidden, weight.to(hidden.dtype), comp_ids,
                                  None if bias is None else bias.to(hidden.dtype),
                                  **logit_transform(model))  # [b, T]
        loss = -(logp * comp_mask).sum() / comp_mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
