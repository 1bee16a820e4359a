"""The state of one training run (`RunState`) and how it is built (`setup`): processes, batch
geometry, rewards, examples, models, optimizer, and the checkpoint being resumed.

Every step reads its inputs from this one object, so what a step depends on is listed here,
with its type. Generation reads the run state too (`generation.generate`).
Shapes: P_l prompts per process, G completions per prompt, B = P_l·G sequences per process,
F reward functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo_kernels import FusedLinearGRPOLoss

from . import batching, sharding, tensor_parallel
from .checkpoint import (
    CHECKPOINT_KEYS,
    check_resumed_config,
    clear_run_files,
    find_checkpoint,
    load_checkpoint,
    resume_run,
    seed_everything,
)
from .checks import grad_filter_value, usable_cores
from .config import TrainConfig, grpo_params, lr_factor
from .data import PromptSampler, load_examples
from .flags import UsageError
from .logs import MetricsLog, printer
from .models import build_models
from .rewards import RewardSpec, accuracy, parse_reward_spec

if TYPE_CHECKING:  # heavy imports, for the annotations only
    from accelerate import Accelerator
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from grpo_kernels.hf import AttentionChoice, RowLayout


@dataclass
class RunState:
    """What the steps of one run read and update; built once by `setup`."""

    # processes
    cfg: TrainConfig  # the resolved, validated configuration
    accel: Accelerator  # processes, their device, gather/reduce, the DDP wrapper
    say: Callable[[str], None]  # prints one line on the main process (above the progress bar)
    rank: int  # this process' data-parallel rank (its index; 0 under --tp_size)
    world: int  # data-parallel processes (the process count; 1 under --tp_size)
    tp: int  # --tp_size: processes per tensor-parallel group, which share one batch
    device: torch.device  # this process' device
    # batch geometry (batching.batch_sizes)
    P_local: int  # prompts per process and step
    B: int  # sequences per process and step, P_local·G
    micro: int  # sequences per micro-batch (a cap: --max_tokens_per_microbatch may cut further)
    agree: Callable[[int], int] | None  # max of an int over processes (None: one process), so
    # that every process runs as many forwards as the others
    # rewards
    specs: list[RewardSpec]  # the --reward functions with their weights
    weights: torch.Tensor  # [F] float32, the reward functions' weights
    acc_col: int | None  # column of the built-in accuracy among the F rewards, if it is one
    # data
    train_ex: list[dict]  # training examples ("prompt", "answer", other columns)
    eval_ex: list[dict]  # held-out examples that have an answer (the others cannot be scored)
    sampler: PromptSampler  # which training examples each step takes; checkpointed
    out_dir: Path  # --output_dir: checkpoints, metrics.jsonl, the final model
    log: MetricsLog  # appends each step's record to out_dir/metrics.jsonl (main process)
    # models
    model: torch.nn.Module  # the policy (PEFT-wrapped with LoRA, FSDP-sharded with --fsdp)
    ref_model: torch.nn.Module | None  # frozen initial policy; None if beta = 0 or with LoRA
    ddp_model: torch.nn.Module  # the policy as the loss calls it: DDP-wrapped on several
    # processes (except FSDP), else the policy itself
    model_config: PretrainedConfig  # the policy's config: the attention implementation sets
    # the packed rows' width and the shared rows' mask
    tokenizer: PreTrainedTokenizerBase  # with a pad token; left padding for prompts
    eos_ids: list[int]  # token ids that end a completion; eos_ids[0] ends a forced one
    layout: RowLayout  # micro-batch rows: padded, packed or shared (batching.py)
    attention: AttentionChoice  # the attention implementation of the scoring and loss forwards
    # (set around them: `grpo_kernels.hf.using_attention`; generation keeps the model's own)
    head: dict[str, torch.dtype]  # extra keyword of the fused calls: {"head_dtype": float32}
    # with --fp32_lm_head, else {}
    autocast: torch.autocast  # bf16 autocast with --bf16, else a disabled one
    # optimization
    loss_fn: FusedLinearGRPOLoss  # the fused GRPO loss with the run's hyperparameters
    optimizer: torch.optim.Optimizer  # AdamW over the trainable parameters
    scheduler: torch.optim.lr_scheduler.LambdaLR  # learning-rate factor per optimizer step
    start: int  # step of the resumed checkpoint, 0 for a fresh run
    # generation (generation.py reads and keeps these)
    forced_lengths: Callable[[int], list[int]] | None = None  # completion lengths to force,
    # per call (None: length_forcing.forced_lengths' hook, if any)
    generation_path: str | None = None  # padded, continuous or static (generation.PATHS);
    # decided on the first call (None: not yet)
    generation_reason: str = ""  # why that path, as its log line says
    continuous_logged: bool = False  # whether the continuous path's log line was printed
    prefill_once: bool | None = None  # whether the padded/static paths prefill each prompt
    # once; decided with the path (False beforehand: every row prefills its own prompt)
    static_caches: dict = field(default_factory=dict)  # the static path's caches, by shape
    decode_compile: tuple | None = None  # the static path's (generate keywords, log phrase)
    # rewards: the functions whose None values the log has explained (rewards.explain_none)
    none_explained: set[str] = field(default_factory=set)


def setup(cfg: TrainConfig) -> RunState:
    """The run state, built in this order (it fixes what the seeds give): processes and batch
    geometry, rewards, examples, models, optimizer, prompt sampler, and the state of the
    checkpoint being resumed (`start`: its step, else 0)."""
    accel, say = _start_processes(cfg)
    tp, device = cfg.tp_size, accel.device
    rank, world = accel.process_index // tp, accel.num_processes // tp  # data-parallel
    P_local, B, micro = batching.batch_sizes(cfg, world, say)
    if cfg.micro_batch_size is None:  # auto: the checkpoint and the steps see the size taken
        cfg = dataclasses.replace(cfg, micro_batch_size=micro if cfg.model else 0)
    specs = [parse_reward_spec(s) for s in cfg.reward]  # fails fast on a bad --reward
    if all(s.weight == 0 for s in specs):  # every advantage 0: a run that learns nothing
        raise UsageError(f"--reward {' '.join(cfg.reward)}: every weight is 0, so every reward "
                         "and advantage is 0 and the policy learns nothing from them; give at "
                         "least one function a weight other than 0")
    train_ex, eval_ex = load_examples(cfg, say)
    out_dir = Path(cfg.output_dir)
    ckpt_path = find_checkpoint(cfg.resume, out_dir)
    state = None if ckpt_path is None else load_checkpoint(ckpt_path, CHECKPOINT_KEYS)
    if state is not None:  # before any model loads: the settings must be the checkpoint's
        check_resumed_config(state, cfg, ckpt_path, say)
    # --overwrite deletes the previous run once this one is past its checks, before its first
    # write (the embedded model's initial_model)
    clear = _clear_previous_run(cfg, accel, say)
    model, ref_model, tokenizer, eos_ids, layout, attention = build_models(
        cfg, out_dir, train_ex, device, ckpt_path is None, accel, say, eval_ex, clear)
    clear()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    sampler = PromptSampler(len(train_ex), cfg.seed)
    seed_everything(cfg.seed + rank)  # each process samples different completions
    start = 0
    if state is not None:
        start = resume_run(state, ckpt_path, model, optimizer, scheduler, sampler,
                           accel.process_index, accel.num_processes, say)
        del state  # the model and optimizer hold their own copies now
    # DistributedDataParallel when several processes; FSDP and tensor parallelism: the model
    ddp_model = model if cfg.fsdp or tp > 1 else accel.prepare_model(model)
    return RunState(
        cfg=cfg, accel=accel, say=say, rank=rank, world=world, tp=tp, device=device,
        P_local=P_local, B=B, micro=micro, agree=_agree(accel),
        specs=specs, weights=torch.tensor([s.weight for s in specs]),
        acc_col=next((j for j, s in enumerate(specs) if s.fn is accuracy), None),
        train_ex=train_ex, eval_ex=[ex for ex in eval_ex if ex.get("answer") is not None],
        sampler=sampler, out_dir=out_dir,
        log=MetricsLog(out_dir, accel.is_main_process, resume_step=start or None),
        model=model, ref_model=ref_model, ddp_model=ddp_model,
        model_config=model.config, tokenizer=tokenizer, eos_ids=eos_ids, layout=layout,
        attention=attention,
        head=dict(head_dtype=torch.float32) if cfg.fp32_lm_head else {},
        autocast=torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16),
        loss_fn=FusedLinearGRPOLoss(params=grpo_params(cfg),
                                    grad_filter=grad_filter_value(cfg.grad_filter)),
        optimizer=optimizer, scheduler=scheduler, start=start)


def _start_processes(cfg: TrainConfig) -> tuple[Accelerator, Callable[[str], None]]:
    """(accelerate.Accelerator, say: print on the main process)."""
    from accelerate import Accelerator

    note = set_threads(cfg.num_threads)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    accel = Accelerator(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    _check_backend(cfg.backend, accel.device)
    if cfg.fsdp:
        sharding.require_process_group()
    tensor_parallel.require(cfg.tp_size, accel.num_processes)
    say = printer(accel.is_main_process)
    if note:
        say(note)
    return accel, say


def set_threads(n: int) -> str | None:
    """torch.set_num_threads(n) (0: torch's default); a warning line when n is above the cores
    this process may use (`validate` refused n above the system's thread limit; a number torch
    cannot take at all is a UsageError here)."""
    if not n:
        return None
    try:
        torch.set_num_threads(n)
    except (ValueError, RuntimeError) as err:  # 2**31 and up: "Overflow when unpacking long"
        raise UsageError(f"--num_threads {n}: torch cannot set it ({err}); pass a number of "
                         f"threads up to the {usable_cores()} CPU cores this process may use, "
                         "or 0 for torch's default") from err
    cores = usable_cores()
    if n <= cores:
        return None
    return (f"warning: --num_threads {n} is more than the {cores} CPU cores this process may "
            "use: the threads take turns on them, which is usually slower than one per core")


def _clear_previous_run(cfg: TrainConfig, accel: Accelerator, say) -> Callable[[], None]:
    """--overwrite: a function that deletes the previous run's files on its first call (every
    process calls it; later calls do nothing). Called once the run's checks passed (the batch,
    the rewards, the data, the models and their positions): a run refused on one of them
    deleted the previous run for nothing. The embedded model calls it before it writes
    OUTPUT_DIR/initial_model."""
    done = []

    def clear() -> None:
        if done:
            return
        done.append(True)
        if cfg.overwrite and accel.is_main_process:
            deleted = clear_run_files(cfg.output_dir)
            if deleted:
                say(f"--overwrite: deleted the previous run's {', '.join(deleted)} in "
                    f"{cfg.output_dir}")
        accel.wait_for_everyone()

    return clear


def _check_backend(backend: str, device: torch.device) -> None:
    """--backend triton off CUDA runs only in Triton's interpreter; without it the first loss
    call failed with a RuntimeError traceback, after the model had loaded and generated."""
    from grpo_kernels.kernels.tile_configs import INTERPRET

    if backend == "triton" and device.type != "cuda" and not INTERPRET:
        raise UsageError(f"--backend triton needs a CUDA device, and this run is on "
                         f"{device.type}: pass --backend chunked (or auto, which takes it on a "
                         "CPU), or set TRITON_INTERPRET=1 for Triton's interpreter (slow)")


def _agree(accel: Accelerator) -> Callable[[int], int] | None:
    """max(n) over the processes, for micro-batch counts that must match (batching.py); None
    with one process, where there is nothing to agree on."""
    if accel.num_processes == 1:
        return None
    return lambda n: int(accel.reduce(torch.tensor(n, device=accel.device), "max").item())
