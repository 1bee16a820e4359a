"""The GRPO training loop, to be read top to bottom.

`train(cfg)` sets up (processes, data, models, optimizer, checkpoint), evaluates at step 0, then
runs `cfg.steps` steps. One step:
  1. sample P prompts (this process takes P / processes of them) and generate G completions each;
  2. score them with the reward functions (NaN = unscored);
  3. gather the rewards of all processes and compute group-normalized advantages;
  4. old log-probs (num_iterations > 1) and reference log-probs (beta > 0), no grad, no logits;
  5. the fused GRPO loss over micro-batches with gradient accumulation, clipping, optimizer and
     scheduler steps (num_iterations times on the same completions).
Shapes: P_l prompts per process, B = P_l·G sequences, Lp prompt columns, T completion columns.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from pathlib import Path

import torch

from grpo_kernels import FusedLinearGRPOLoss, force_backend
from grpo_kernels import reference as reference_impl
from grpo_kernels.hf import check_packed_attention

from . import batching, sharding
from .checkpoint import (
    StopOnSignal,
    capture_rng,
    clear_run_files,
    find_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    seed_everything,
)
from .config import grad_filter_value, grpo_params, lr_factor
from .data import PromptSampler, load_examples
from .flags import UsageError
from .generation import evaluate, generate
from .logs import (
    MetricsLog,
    format_line,
    plot_curves,
    printer,
    progress_bar,
    read_metrics,
    show,
    step_metrics,
)
from .models import (
    add_lora_adapters,
    build_embedded,
    eos_token_ids,
    format_warmup,
    load_pretrained,
    save_model,
    use_fp32_head,
)
from .rewards import accuracy, combine, group_advantages, parse_reward_spec, score
from .sharding import causal_lm_grpo_loss, causal_lm_logprobs  # hf's, via FSDP hooks if sharded


class NoPhases:
    """The phase hooks of a step when nothing records them. A benchmark passes an object with
    the same two context managers (benchmarks/phases.py) to see where time and memory go."""

    @contextlib.contextmanager
    def step(self):
        yield

    @contextlib.contextmanager
    def phase(self, name: str):
        yield


def train(cfg, phases=None) -> dict:
    """Run GRPO with a prepared config (as `grpo_train.train` makes it: "auto" fields filled,
    validated, output directory checked); returns {"step", "interrupted", "eval_accuracy":
    {step: acc}, "model", "tokenizer", "main_process"}. phases: see `NoPhases`."""
    phases = NoPhases() if phases is None else phases
    if cfg.backend == "auto":  # CUDA -> Triton kernels; CPU -> chunked PyTorch (or interpreter)
        return _train(cfg, phases)
    with force_backend(cfg.backend):
        return _train(cfg, phases)


def _train(cfg, phases) -> dict:
    # ---- processes and batch geometry ---------------------------------------------------------
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    accel = Accelerator(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    rank, world, device = accel.process_index, accel.num_processes, accel.device
    if cfg.fsdp:
        sharding.require_process_group()
    say = printer(accel.is_main_process)
    if cfg.overwrite and accel.is_main_process:
        deleted = clear_run_files(cfg.output_dir)
        if deleted:
            say(f"--overwrite: deleted the previous run's {', '.join(deleted)} in "
                f"{cfg.output_dir}")
    accel.wait_for_everyone()
    G = cfg.num_generations
    if cfg.num_prompts % world:
        raise UsageError(f"--num_prompts {cfg.num_prompts} must be divisible by the number of "
                         f"processes ({world}): every process takes whole groups")
    P_local = cfg.num_prompts // world
    B = P_local * G
    micro = cfg.micro_batch_size or B  # sequences per micro-batch, unless a token budget
    if B % micro and not cfg.max_tokens_per_microbatch:
        raise UsageError(f"--micro_batch_size {micro} must divide the per-process batch "
                         f"num_prompts/processes x num_generations = {P_local} x {G} = {B}")

    # ---- data, rewards, models ----------------------------------------------------------------
    specs = [parse_reward_spec(s) for s in cfg.reward]  # fails fast on a bad --reward
    weights = torch.tensor([s.weight for s in specs])
    acc_col = next((j for j, s in enumerate(specs) if s.fn is accuracy), None)
    train_ex, eval_ex = load_examples(cfg)
    eval_ex = [ex for ex in eval_ex if ex.get("answer") is not None]  # scorable ones only
    out_dir = Path(cfg.output_dir)
    ckpt_path = find_checkpoint(cfg.resume, out_dir)
    model, tokenizer = _load_policy(cfg, out_dir, train_ex, device, ckpt_path is None, accel, say)
    if cfg.fp32_lm_head:
        use_fp32_head(model)
    ref_model = None  # beta = 0 needs no reference at all
    if cfg.beta != 0.0 and not cfg.lora_r:  # the frozen initial policy
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if cfg.lora_r:  # adapters on the policy only: the reference is the model without them, so
        model = add_lora_adapters(model, cfg, say)  # no copy (`_adapters_off`)
    eos_ids = eos_token_ids(model, tokenizer)
    packed = _padding_free(model, cfg, say)  # before any wrapper: checks the bare model once
    # flash attention works on the packed sequences themselves: one row; dense masks: rows as
    # wide as the longest sequence (attention then costs no more than on padded rows)
    one_row = "flash" in str(getattr(model.config, "_attn_implementation", ""))
    if cfg.gradient_checkpointing:  # transformers >= 5.2x renamed the method
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    if cfg.fsdp:  # shard in place before the optimizer sees the parameters (see sharding.py)
        model = sharding.shard_model(model, device)
        if ref_model is not None:
            ref_model = sharding.shard_model(ref_model, device, frozen=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    sampler = PromptSampler(len(train_ex), cfg.seed)
    seed_everything(cfg.seed + rank)  # each process samples different completions
    start = 0
    if ckpt_path is not None:
        state = load_checkpoint(ckpt_path)
        sharding.load_state_dicts(model, optimizer, state["model"], state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["data"])
        if len(state["rng"]) == world:
            restore_rng(state["rng"][rank])
        else:
            say(f"warning: checkpoint has RNG states for {len(state['rng'])} processes, this run "
                f"has {world}; sampling will differ from an uninterrupted run")
        start = state["step"]
        say(f"resumed from {ckpt_path} at step {start}")
    # DistributedDataParallel when several processes; FSDP: the sharded model as it is
    ddp_model = model if cfg.fsdp else accel.prepare_model(model)
    # every process must run as many forwards as the others (batching.py)
    agree = None if world == 1 else (
        lambda n: int(accel.reduce(torch.tensor(n, device=device), "max").item()))
    loss_fn = FusedLinearGRPOLoss(params=grpo_params(cfg),
                                  grad_filter=grad_filter_value(cfg.grad_filter))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    log = MetricsLog(out_dir, accel.is_main_process, resume_step=start if start else None)
    ctx = dict(cfg=cfg, accel=accel, tokenizer=tokenizer, eos_ids=eos_ids, autocast=autocast,
               say=say)  # say: generation logs the path it runs once
    head = dict(head_dtype=torch.float32) if cfg.fp32_lm_head else {}  # fused calls' head dtype

    def checkpoint(step):
        rng = gather_object([capture_rng()])  # every process' RNG state, in rank order
        model_sd, optim_sd = sharding.state_dicts(model, optimizer)  # FSDP: gathered, full
        if accel.is_main_process:
            payload = dict(step=step, model=model_sd, optimizer=optim_sd,
                           scheduler=scheduler.state_dict(), data=sampler.state_dict(), rng=rng,
                           config=dataclasses.asdict(cfg))
            path = save_checkpoint(out_dir, step, payload, cfg.keep_checkpoints)
            say(f"checkpoint {path}")
        accel.wait_for_everyone()

    # ---- the loop -----------------------------------------------------------------------------
    history = {}  # step -> held-out accuracy, including the evals before a resume
    if start and log.path.exists():
        history = {r["step"]: r["eval_accuracy"] for r in read_metrics(log.path)
                   if "eval_accuracy" in r}
    if start == 0 and cfg.eval_every and eval_ex:
        history[0] = evaluate(model, eval_ex, ctx)
        log.write({"step": 0, "eval_accuracy": history[0]})
        say(f"step 0 | eval_acc {history[0]:.3f} (held-out, greedy, {len(eval_ex)} prompts)")
    bar = progress_bar(cfg, accel.is_main_process, start)
    step, last_saved, interrupted = start, start, False
    with StopOnSignal(say) as stop:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            examples = [train_ex[i] for i in sampler.next(cfg.num_prompts)]
            examples = examples[rank * P_local:(rank + 1) * P_local]  # this process' prompts
            with phases.step():
                # 1. generate G completions per prompt: [B, Lp + T]
                with phases.phase("generation"):
                    batch = generate(model, examples, ctx)
                with phases.phase("scoring"):
                    # 2.-3. rewards [B, F] of this process -> all processes -> advantages [B]
                    rewards_per_func, failures = score(specs, batch["prompts"], batch["texts"],
                                                       batch["columns"])
                    all_rewards = accel.gather(rewards_per_func.to(device)).cpu()  # [P*G, F]
                    rewards = combine(all_rewards, weights)
                    advantages = group_advantages(rewards, G, cfg.scale_rewards)
                    advantages = advantages[rank * B:(rank + 1) * B].to(device)
                    # 4. micro-batches (packed rows or padded, batching.py), then reference and
                    # old log-probs per micro-batch ([b, T] or [N], float32, no grad, no
                    # logits); the policy in train mode, as in the loss below, so the first
                    # ratio is exactly 1
                    mbs = batching.micro_batches(batch, packed, micro,
                                                 cfg.max_tokens_per_microbatch, agree, one_row)
                    model.train()
                    with autocast:
                        ref_logps = [None] * len(mbs)
                        if cfg.beta != 0.0:
                            with _reference_policy(model, ref_model) as reference:
                                ref_logps = [_logprobs(reference, mb, cfg, head) for mb in mbs]
                        old_logps = [None] * len(mbs)
                        if cfg.num_iterations > 1:
                            old_logps = [_logprobs(model, mb, cfg, head) for mb in mbs]
                # 5. optimize: micro-batches, accumulation normalized as TRL does
                num_items = None
                if loss_fn.params.normalizes_by_token_count:
                    # per-process share of the step's token count: DDP averages the gradients,
                    # so the micro-batch losses add up to sum(token losses) / all tokens
                    n_tokens = batch["completion_mask"].sum().float()
                    num_items = accel.reduce(n_tokens, "sum") / world
                sums, loss_total, grad_norms = {}, 0.0, []
                for _ in range(cfg.num_iterations):
                    with phases.phase("loss"):  # forward + backward of every micro-batch
                        for i, mb in enumerate(mbs):
                            sync = i == len(mbs) - 1 or world == 1
                            no_sync = contextlib.nullcontext() if sync else ddp_model.no_sync()
                            with no_sync, autocast:
                                loss, metrics = _loss(ddp_model, loss_fn, mb, advantages[mb.seqs],
                                                      old_logps[i], ref_logps[i], num_items,
                                                      cfg.loss, head)
                                if num_items is None:  # per-sequence means: weight by share
                                    loss = loss * (mb.num_seqs / B)  # (1/n_micro if equal)
                            loss.backward()
                            loss_total += loss.item() / cfg.num_iterations
                            n_tok = mb.num_loss_tokens
                            for k, v in metrics.items():
                                sums[k] = sums.get(k, 0.0) + v.item() * n_tok
                            sums["_tokens"] = sums.get("_tokens", 0.0) + n_tok
                    with phases.phase("optimizer"):
                        clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
                        grad_norms.append(sharding.clip_grad_norm(model, clip))
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)

            # ---- metrics, eval, checkpoint ------------------------------------------------------
            record = step_metrics(step, ctx, batch, all_rewards, rewards, acc_col, sums,
                                   loss_total, grad_norms, scheduler, t0, device)
            fails = {k: v for d in gather_object([failures]) for k, v in d.items()}
            if fails:
                record["reward_failures"] = fails
                say(f"warning: unscored completions at step {step}: {fails}")
            if cfg.eval_every and eval_ex and (step % cfg.eval_every == 0 or step == cfg.steps):
                record["eval_accuracy"] = history[step] = evaluate(model, eval_ex, ctx)
            log.write(record)
            show(bar, say, format_line(record))
            stop_now = accel.reduce(torch.tensor(float(stop.requested), device=device), "max")
            if stop_now.item() > 0:
                interrupted = True
                break
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint(step)
                last_saved = step
    if bar is not None:
        bar.close()

    # ---- the end ------------------------------------------------------------------------------
    if step != last_saved and (cfg.save_every or interrupted):
        checkpoint(step)
    model = sharding.export_model(model)  # FSDP: a plain full model on the main process
    if interrupted:
        say(f"stopped at step {step}; continue with --resume auto --output_dir {out_dir}")
    elif accel.is_main_process:
        if cfg.save_final_model and cfg.steps > 0:
            save_model(model, tokenizer, out_dir / "final_model")
        if cfg.plot:
            say(plot_curves(out_dir))
    accel.wait_for_everyone()
    return {"step": step, "interrupted": interrupted, "eval_accuracy": history,
            "model": model, "tokenizer": tokenizer, "main_process": accel.is_main_process}


# ---- the pieces of a step -----------------------------------------------------------------------


def _padding_free(model, cfg, say) -> bool:
    """Whether micro-batches are packed rows: --padding_free (the default) and a model that
    attends within the sequences of a packed row (checked once on it); else one line why not."""
    if not cfg.padding_free:
        say("micro-batches: padded (--no_padding_free)")
        return False
    reason = check_packed_attention(model)
    if reason is not None:
        say(f"micro-batches: padded, not packed: {reason}")
        return False
    say("micro-batches: packed rows, no padding (--padding_free)")
    return True


def _logprobs(model, mb, cfg, head):
    """No-grad log-probs of one micro-batch's completion tokens: [b, T] padded, [N] packed."""
    return causal_lm_logprobs(model, *mb.inputs, temperature=cfg.temperature,
                              position_ids=mb.position_ids, **head)


def _loss(model, loss_fn, mb, adv, old, ref, num_items, which, head):
    """(loss, metrics) of one micro-batch: the fused loss from hidden states, or the reference
    that materializes [b, T, V] (packed: [N, V]) logits, for comparison and benchmarks.
    adv: [b] of its sequences; old/ref: from `_logprobs`; head: head_dtype."""
    if which == "fused":
        return causal_lm_grpo_loss(model, *mb.inputs, adv, mb.mask, old, ref, loss_fn=loss_fn,
                                   num_items_in_batch=num_items, cu_seqlens=mb.cu_seqlens,
                                   position_ids=mb.position_ids, **head)
    ids, attn, keep = mb.inputs
    if mb.packed is None:
        logits = model(input_ids=ids, attention_mask=attn, position_ids=mb.position_ids,
                       logits_to_keep=keep + 1, use_cache=False).logits[:, :-1]  # [b, T, V]
        targets = ids[:, -keep:]
    else:  # transformers keeps packed positions given as a boolean [R, W] mask, row-major
        where = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
        where[keep] = True
        logits = model(input_ids=ids, position_ids=mb.position_ids,
                       logits_to_keep=where.view(ids.shape), use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1])[keep.argsort().argsort()]  # [N, V]
        targets = ids.reshape(-1)[keep + 1]
    return reference_impl.grpo_loss(logits, targets, adv, mb.mask, old, ref,
                                    num_items_in_batch=num_items, cu_seqlens=mb.cu_seqlens,
                                    params=loss_fn.params)


def _load_policy(cfg, out_dir: Path, train_ex, device, fresh: bool, accel, say):
    """The policy at step 0. The embedded model is built (and format-warmed-up) once, and saved
    to OUTPUT_DIR/initial_model so that a resumed run restarts from exactly the same weights."""
    if cfg.model:
        model, tokenizer = load_pretrained(cfg.model, cfg)
        return model.to(device), tokenizer
    initial = out_dir / "initial_model"
    if not fresh and initial.is_dir():
        model, tokenizer = load_pretrained(str(initial), cfg, flag="initial model")
        return model.to(device), tokenizer
    model, tokenizer = build_embedded(cfg)
    model.to(device)
    losses = format_warmup(model, tokenizer, train_ex, cfg, device)
    if losses:
        say(f"format warm-up: {len(losses)} supervised steps on random answers, loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f} (teaches digits-then-EOS, not the sums)")
    if accel.is_main_process:
        save_model(model, tokenizer, initial)
    accel.wait_for_everyone()
    return model, tokenizer


@contextlib.contextmanager
def _reference_policy(model, ref_model):
    """The reference policy to score with: the frozen copy, or for a LoRA policy (no copy) the
    policy itself with its adapters disabled and in eval mode, as the copy would be."""
    if ref_model is not None:
        yield ref_model
        return
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():  # PEFT: the base model, i.e. the initial policy
            yield model
    finally:
        model.train(was_training)
