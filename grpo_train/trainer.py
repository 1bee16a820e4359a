"""The GRPO training loop, to be read top to bottom.

`train(cfg)` builds the run state (`run_state.setup`: processes, data, models, optimizer, the
resumed checkpoint), evaluates at step 0 (`_first_eval`), then runs `cfg.steps` steps (`_step`),
each followed by its log line, eval, stop checks (Ctrl-C; --max_unscored_steps steps in a row
without a scored completion, which raises `rewards.RewardsFailedError`) and checkpoint, and ends
with `_finish`. Every helper below reads what it needs from that one `RunState`. One step:
  1. sample P prompts (this process takes P / processes of them) and generate G completions each;
  2. score them with the reward functions (NaN = unscored);
  3. gather the rewards of all processes and compute group-normalized advantages (`_advantages`);
  4. old log-probs (num_iterations > 1) and reference log-probs (beta > 0), no grad, no logits
     (`_scoring_logprobs`);
  5. the fused GRPO loss over micro-batches with gradient accumulation (`_backward`), clipping,
     optimizer and scheduler steps, num_iterations times on the same completions (`_optimize`).
Shapes: P_l prompts per process, B = P_l·G sequences, Lp prompt columns, T completion columns.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from grpo_kernels import force_backend, hf
from grpo_kernels import reference as reference_impl

from . import batching, sharding, tensor_parallel
from .checkpoint import StopOnSignal, checkpoint_dir, list_checkpoints, save_run
from .generation import evaluate, generate
from .logs import (
    format_line,
    plot_curves,
    progress_bar,
    read_metrics,
    route_lines,
    show,
    step_metrics,
    step_start,
)
from .models import save_model
from .rewards import combine, explain_none, group_advantages, rewards_failed, score
from .run_state import RunState, setup


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
    {step: acc}, "model", "tokenizer", "main_process", "layout", "attention", "generation"}
    (the last three: the micro-batches' row layout, the scoring and loss forwards' attention
    implementation, the generation path that ran). phases: see `NoPhases`."""
    phases = NoPhases() if phases is None else phases
    # "auto": CUDA -> Triton kernels; CPU -> chunked PyTorch (or interpreter)
    backend = contextlib.nullcontext() if cfg.backend == "auto" else force_backend(cfg.backend)
    threads = torch.get_num_threads()
    try:
        with backend, route_lines() as routes:
            return _train(cfg, phases, routes)
    finally:  # --num_threads is the run's: a Python caller of train() gets its own count back
        torch.set_num_threads(threads)


def _train(cfg, phases, routes) -> dict:
    run = setup(cfg)  # processes, data, rewards, models, optimizer; the checkpoint's state
    routes.start(run.say)  # the kernels' route lines from here (the warm-up's held till now)
    history = _first_eval(run)  # step -> held-out accuracy, including the evals before a resume
    # Ctrl-C or SIGTERM from here on lets what runs finish: a step, an eval, and the saves at
    # the end too (a first Ctrl-C that aborted the last checkpoint in mid-write lost every step
    # since the one before, all of them in a run without --save_every checkpoints)
    with StopOnSignal(run.say) as stop:
        step, last_saved, interrupted, unscored, record = _loop(run, history, stop, phases)
        if not interrupted and cfg.max_unscored_steps and unscored >= cfg.max_unscored_steps:
            found = list_checkpoints(checkpoint_dir(cfg.output_dir))
            raise rewards_failed(record.get("reward_failures", {}), unscored, step,
                                 cfg.num_prompts * cfg.num_generations,
                                 found[-1] if found else None)
        if step != last_saved and (cfg.save_every or interrupted):
            # the last step's state, to resume from; during unscored steps without deleting
            # the checkpoints written before them
            _checkpoint(run, step, prune=not (unscored and cfg.max_unscored_steps))
        return _finish(run, step, interrupted, history)


def _loop(run: RunState, history: dict, stop, phases):
    """The steps after the checkpoint's, each with its log line, eval and scheduled checkpoint,
    until --steps, a stop request or --max_unscored_steps unscored steps in a row; returns
    (last step, last step saved, interrupted, unscored steps in a row, last record)."""
    cfg = run.cfg
    bar = progress_bar(cfg, run.accel.is_main_process, run.start)
    step, last_saved, interrupted, unscored, record = run.start, run.start, False, 0, {}
    for step in range(run.start + 1, cfg.steps + 1):
        record = _step(run, step, phases)  # generate, score, optimize: the step's metrics
        if cfg.eval_every and run.eval_ex and (step % cfg.eval_every == 0 or step == cfg.steps):
            record["eval_accuracy"] = history[step] = evaluate(run.model, run.eval_ex, run)
        run.log.write(record)
        show(bar, run.say, format_line(record))
        # steps in a row without one scored completion (the same count on every process: the
        # record's rewards are gathered)
        all_unscored = record["unscored"] == cfg.num_prompts * cfg.num_generations
        unscored = unscored + 1 if all_unscored else 0
        # a stop request during the last step ends the run as the last step does: marked
        # interrupted, it skipped the final model, which a resume of the complete run never wrote
        if step < cfg.steps and _stop_requested(run, stop):
            interrupted = True
            break
        if cfg.max_unscored_steps and unscored >= cfg.max_unscored_steps:
            break
        if _save_due(cfg, step, last_saved, unscored):
            _checkpoint(run, step)
            last_saved = step
            if step < cfg.steps and _stop_requested(run, stop):  # Ctrl-C during the save
                interrupted = True
                break
    if bar is not None:
        bar.close()
    return step, last_saved, interrupted, unscored, record


# ---- before the first step ----------------------------------------------------------------------


def _first_eval(run: RunState) -> dict:
    """{step: held-out accuracy}: a resumed run's earlier evals, or the eval at step 0."""
    history = {}
    if run.start and run.log.path.exists():
        history = {r["step"]: r["eval_accuracy"] for r in read_metrics(run.log.path)
                   if "eval_accuracy" in r}
    if run.start == 0 and run.cfg.eval_every and run.eval_ex:
        history[0] = evaluate(run.model, run.eval_ex, run)
        run.log.write({"step": 0, "eval_accuracy": history[0]})
        run.say(f"step 0 | eval_acc {history[0]:.3f} (held-out, greedy, {len(run.eval_ex)} "
                "prompts)")
    return history


# ---- one step -----------------------------------------------------------------------------------


def _step(run: RunState, step: int, phases) -> dict:
    """One step (the module docstring's 1.-5.); returns its metrics record, eval not included."""
    from accelerate.utils import gather_object

    cfg, start = run.cfg, step_start()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    examples = [run.train_ex[i] for i in run.sampler.next(cfg.num_prompts)]
    first = run.rank * run.P_local
    examples = examples[first:first + run.P_local]  # this process' prompts
    with phases.step():
        # 1. generate G completions per prompt: [B, Lp + T]
        with phases.phase("generation"):
            batch = generate(run.model, examples, run)
        # scoring and loss forwards run the chosen attention (run.attention); generation
        # keeps the model's own
        with hf.using_attention([run.model, run.ref_model], run.attention.implementation):
            with phases.phase("scoring"):
                # 2.-3. rewards [B, F] of this process -> all processes -> advantages [B]
                rewards_per_func, failures = score(run.specs, batch["prompts"], batch["texts"],
                                                   batch["columns"])
                all_rewards, rewards, advantages = _advantages(run, rewards_per_func)
                # 4. micro-batches (shared-prefix, packed or padded rows, batching.py), then
                # reference and old log-probs per micro-batch
                mbs = batching.micro_batches(batch, run.layout, run.micro,
                                             cfg.max_tokens_per_microbatch, run.agree,
                                             run.model_config)
                ref_logps, old_logps = _scoring_logprobs(run, mbs)
            # 5. optimize: micro-batches, accumulation normalized as TRL does
            sums, loss_total, grad_norms = _optimize(run, batch, mbs, advantages, old_logps,
                                                     ref_logps, phases)
    record = step_metrics(run, step, batch, all_rewards, rewards, sums, loss_total, grad_norms,
                          start)
    fails = {k: v for d in gather_object([failures]) for k, v in d.items()}
    if fails:
        record["reward_failures"] = fails
        run.say(f"warning: unscored completions at step {step}: {fails}")
        note = explain_none(fails, run.none_explained)  # once per function and run
        if note:
            run.say(note)
    return record


def _advantages(run: RunState, rewards_per_func):
    """(all processes' rewards [P·G, F], their weighted sum [P·G], this process' advantages
    [B] on its device) from this process' rewards [B, F] (NaN = unscored)."""
    all_rewards = run.accel.gather(rewards_per_func.to(run.device)).cpu()  # [P*G, F]
    # each tensor-parallel group once (its ranks scored the same batch)
    all_rewards = tensor_parallel.data_rows(all_rewards, run.tp, run.accel.num_processes)
    rewards = combine(all_rewards, run.weights)
    advantages = group_advantages(rewards, run.cfg.num_generations, run.cfg.scale_rewards)
    return all_rewards, rewards, advantages[run.rank * run.B:(run.rank + 1) * run.B].to(run.device)


def _scoring_logprobs(run: RunState, mbs):
    """(reference, old) log-probs of each micro-batch ([b, T] or [N], float32, no grad, no
    logits), None where beta = 0 / num_iterations = 1. The policy in train mode, as in the loss,
    so the first ratio is exactly 1 (under a config's dropout, GPT-2's 0.1, only in expectation:
    each forward draws its own masks)."""
    cfg = run.cfg
    run.model.train()
    with run.autocast:
        ref_logps = [None] * len(mbs)
        if cfg.beta != 0.0:
            with _reference_policy(run.model, run.ref_model) as reference:
                ref_logps = [_logprobs(reference, mb, cfg, run.head) for mb in mbs]
        old_logps = [None] * len(mbs)
        if cfg.num_iterations > 1:
            old_logps = [_logprobs(run.model, mb, cfg, run.head) for mb in mbs]
    return ref_logps, old_logps


def _optimize(run: RunState, batch, mbs, advantages, old_logps, ref_logps, phases):
    """num_iterations optimizer steps on the same micro-batches; returns (metric sums weighted
    by loss tokens, with their "_tokens", the mean loss, each optimizer step's gradient norm)."""
    cfg = run.cfg
    num_items = None
    if run.loss_fn.params.normalizes_by_token_count:
        # per-process share of the step's token count: DDP averages the gradients,
        # so the micro-batch losses add up to sum(token losses) / all tokens
        n_tokens = batch["completion_mask"].sum().float()
        # at least 1: a step whose completions are all masked has a zero loss, not an error
        # (summed over every process: a tensor-parallel group's ranks count alike)
        num_items = (run.accel.reduce(n_tokens, "sum") / run.accel.num_processes).clamp(
            min=1.0)
    sums, loss_total, grad_norms = {}, 0.0, []
    for _ in range(cfg.num_iterations):
        with phases.phase("loss"):  # forward + backward of every micro-batch
            for i, mb in enumerate(mbs):
                sync = i == len(mbs) - 1 or run.world == 1
                loss_total += _backward(run, mb, sync, advantages[mb.seqs], old_logps[i],
                                        ref_logps[i], num_items, sums)
        with phases.phase("optimizer"):
            clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
            grad_norms.append(sharding.clip_grad_norm(run.model, clip))
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
    return sums, loss_total, grad_norms


def _backward(run: RunState, mb, sync: bool, adv, old, ref, num_items, sums: dict) -> float:
    """Forward + backward of one micro-batch, gradients synchronized across processes only if
    `sync` (the last one); adds its metrics x its loss tokens into `sums`; returns its loss /
    num_iterations. adv: [b] of its sequences; old/ref: from `_logprobs` or None."""
    # the backward inside no_sync too: FSDP2 reads its sync setting when the backward runs
    no_sync = contextlib.nullcontext() if sync else run.ddp_model.no_sync()
    with no_sync:
        with run.autocast:
            loss, metrics = _loss(run.ddp_model, run.loss_fn, mb, adv, old, ref, num_items,
                                  run.cfg.loss, run.head)
            if num_items is None:  # per-sequence means: weight by share
                loss = loss * (mb.num_seqs / run.B)  # (1/n_micro if equal)
        loss.backward()
    value = loss.item() / run.cfg.num_iterations
    n_tok = mb.num_loss_tokens
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v.item() * n_tok
    sums["_tokens"] = sums.get("_tokens", 0.0) + n_tok
    return value


# ---- the loss and the log-probs of a micro-batch ----------------------------------------------


def _logprobs(model, mb, cfg, head):
    """No-grad log-probs of one micro-batch's completion tokens: [b, T] padded, [N] packed.
    A sharded model runs it as a forward of its FSDP2 root (`hf.run_as_forward`), so FSDP's
    hooks unshard the head; no_grad around them too: nothing to prepare for a backward."""
    with torch.no_grad():
        return hf.run_as_forward(model, lambda m: hf.causal_lm_logprobs(
            m, *mb.inputs, temperature=cfg.temperature, **mb.model_kwargs, **head))


def _loss(model, loss_fn, mb, adv, old, ref, num_items, which, head):
    """(loss, metrics) of one micro-batch: the fused loss from hidden states, or the reference
    that materializes [b, T, V] (packed: [N, V]) logits, for comparison and benchmarks.
    adv: [b] of its sequences; old/ref: from `_logprobs`; head: head_dtype."""
    if which == "fused":  # sharded: as a forward of the FSDP2 root (`hf.run_as_forward`)
        return hf.run_as_forward(model, lambda m: hf.causal_lm_grpo_loss(
            m, *mb.inputs, adv, mb.mask, old, ref, loss_fn=loss_fn, num_items_in_batch=num_items,
            cu_seqlens=mb.cu_seqlens, **mb.model_kwargs, **head))
    ids, attn, keep = mb.inputs
    # logits only: a config asking for router logits would add the MoE aux loss over `attn`,
    # which fails on shared rows' 4-D mask
    kwargs = dict(mb.model_kwargs, use_cache=False, **hf.router_logits_off(model))
    if mb.packed is None:
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep + 1,
                       **kwargs).logits[:, :-1]  # [b, T, V]
        targets = ids[:, -keep:]
    else:
        where = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
        where[keep] = True
        if _keeps_a_boolean_mask():  # the kept positions' logits only, row-major
            logits = model(input_ids=ids, attention_mask=attn,
                           logits_to_keep=where.view(ids.shape), **kwargs).logits
            logits = logits.reshape(-1, logits.shape[-1])
        else:  # older transformers: every position's logits [R, W, V], then the kept ones
            logits = model(input_ids=ids, attention_mask=attn, **kwargs).logits
            logits = logits.reshape(-1, logits.shape[-1])[where]
        logits = logits[keep.argsort().argsort()]  # [N, V]
        targets = ids.reshape(-1)[keep + 1]
    return reference_impl.grpo_loss(logits, targets, adv, mb.mask, old, ref,
                                    num_items_in_batch=num_items, cu_seqlens=mb.cu_seqlens,
                                    params=loss_fn.params)


@functools.cache
def _keeps_a_boolean_mask() -> bool:
    """Whether this transformers takes a boolean [R, W] `logits_to_keep` (packed rows: the
    kept positions' logits, flattened); releases without `slice_logits_to_keep` (5.17 and
    older) index the sequence dimension only."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401
    except ImportError:
        return False
    return True


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


# ---- after a step, and the end ------------------------------------------------------------------


def _stop_requested(run: RunState, stop) -> bool:
    """Whether any process got Ctrl-C or SIGTERM: all of them then stop after the same step."""
    stop_now = run.accel.reduce(torch.tensor(float(stop.requested), device=run.device), "max")
    return stop_now.item() > 0


def _save_due(cfg, step: int, last_saved: int, unscored: int) -> bool:
    """Whether `step` writes its checkpoint: a multiple of --save_every has been reached since
    the last one. While no completion is scored and --max_unscored_steps may stop the run, the
    save waits for the next scored step: its pruning (--keep_checkpoints) could otherwise
    delete the last checkpoint written before the rewards failed."""
    if not cfg.save_every or (unscored and cfg.max_unscored_steps):
        return False
    return step // cfg.save_every > last_saved // cfg.save_every


def _checkpoint(run: RunState, step: int, prune: bool = True) -> None:
    """Save the run's state at `step` (every process calls it; see checkpoint.save_run)."""
    save_run(step, run.cfg, run.accel, run.model, run.optimizer, run.scheduler, run.sampler,
             run.say, prune)


def _finish(run: RunState, step: int, interrupted: bool, history: dict) -> dict:
    """train()'s result; the final model saved and the curves plotted unless interrupted."""
    cfg, accel = run.cfg, run.accel
    model = sharding.export_model(run.model)  # FSDP: a plain full model on the main process
    if interrupted:
        run.say(f"stopped at step {step}; continue with --resume auto --output_dir {run.out_dir}")
    elif accel.is_main_process:
        if cfg.save_final_model and cfg.steps > 0:
            save_model(model, run.tokenizer, run.out_dir / "final_model")
        if cfg.plot:
            run.say(plot_curves(run.out_dir))
    accel.wait_for_everyone()
    return {"step": step, "interrupted": interrupted, "eval_accuracy": history,
            "model": model, "tokenizer": run.tokenizer, "main_process": accel.is_main_process,
            "layout": str(run.layout), "attention": run.attention.implementation,
            "generation": run.generation_path}
