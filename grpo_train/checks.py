"""Which settings can work: `validate` raises a UsageError naming the flag (its choices, its
bounds, the combinations that contradict each other, paths that do not exist) before anything is
loaded; `grpo_params` derives the loss' hyperparameters and maps the loss' own errors to flag
names."""

from __future__ import annotations

import dataclasses
import math
import os
import re

from grpo_kernels.params import ALL_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS

from .config import TrainConfig, grpo_params
from .flags import MissingPathError, UsageError

# The values these fields accept (--help shows them as the flag's metavar).
CHOICES = {
    "tiny_arch": ("qwen2", "llama"),
    "model_dtype": ("float32", "bfloat16", "float16"),
    "loss": ("fused", "reference"),
    "loss_type": ALL_LOSS_TYPES,
    "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "scale_rewards": ("group", "batch", "none"),
    "backend": ("auto", "triton", "chunked"),
    "lr_scheduler": ("constant", "linear", "cosine"),
    "device": ("auto", "cpu", "cuda"),
    "generation": ("auto", "continuous", "padded", "static"),
    # grpo_kernels.hf.attention_choice.IMPLEMENTATIONS (not imported: it loads transformers)
    "attn_implementation": ("auto", "sdpa", "eager", "flex_attention", "torch_varlen_flash"),
}


# (flag, lowest allowed value, whether the lowest is excluded)
_LOWER_BOUNDS = [
    ("num_prompts", 1, False), ("max_new_tokens", 1, False), ("num_iterations", 1, False),
    ("steps", 0, False), ("micro_batch_size", 0, False), ("min_new_tokens", 0, False),
    ("eval_size", 0, False), ("eval_every", 0, False), ("eval_batch_size", 1, False),
    ("save_every", 0, False), ("keep_checkpoints", 0, False), ("num_threads", 0, False),
    ("tiny_hidden_size", 1, False), ("tiny_layers", 1, False), ("format_warmup_steps", 0, False),
    ("top_k", 0, False), ("lr_warmup_steps", 0, False), ("max_grad_norm", 0, False),
    ("learning_rate", 0, False), ("weight_decay", 0, False), ("temperature", 0, True),
    ("top_p", 0, True), ("max_prompt_length", 1, False), ("lora_r", 0, False),
    ("tiny_init_std", 0, True), ("max_tokens_per_microbatch", 0, False),
]


# The lowest --temperature: sampling divides the float32 logits z by it and the loss' gradient
# grows as 1/temperature. Measured (docs/trainer.md, Errors): z / temperature overflows to
# inf (transformers' sampling then fails on NaN probabilities) below max|z| / 3.4e38; 1 /
# temperature is no float32 below 2.9e-39; the gradient's float32 norm overflows (NaN weights, or
# a clipped step of zeros) from about 1e-19 down. At 1e-4 a logit gap of 0.01 already gives odds
# of e^100: sampling is greedy in effect, far above all three.
MIN_TEMPERATURE = 1e-4
# The highest --temperature, by the same measure at the other end: at 1e4 a logit spread of 100
# (about the widest a language model's logits span) gives odds of e^0.01 = 1.01 between its
# ends, so sampling is uniform in effect and the loss' gradient, which shrinks as 1/temperature,
# is 1e-4 of its size at 1. Measured (docs/trainer.md, Errors): float32 softmax of logits
# spanning 1, 10 or 100 is exactly uniform from 1e8, 1e9 or 1e10 up, and above 3.4e38 the
# temperature itself is inf in float32 (every logit / temperature is 0).
MAX_TEMPERATURE = 1e4
# --seed: NumPy's generators take no negative seed, torch.manual_seed none above 2**64 - 1 (and
# each process adds its index)
MAX_SEED = 2**63 - 1


def validate(cfg: TrainConfig) -> TrainConfig:
    """Clear errors for settings that cannot work, before anything is loaded (after
    `resolve_auto`). Raises UsageError naming the flag."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise UsageError(f"--{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    _check_numbers(cfg)
    if cfg.num_generations < 2:
        raise UsageError(
            f"--num_generations must be >= 2 (group normalization needs at least two "
            f"completions per prompt), got {cfg.num_generations}"
        )
    for name, low, strict in _LOWER_BOUNDS:
        value = getattr(cfg, name)
        if value is not None and (value <= low if strict else value < low):
            raise UsageError(f"--{name} must be {'>' if strict else '>='} {low}, got {value}")
    if cfg.max_new_tokens is not None and cfg.min_new_tokens > cfg.max_new_tokens:
        # EOS would be suppressed at every position: each completion runs to the cap unended
        raise UsageError(f"--min_new_tokens {cfg.min_new_tokens} exceeds --max_new_tokens "
                         f"{cfg.max_new_tokens}: no completion could end; lower it or raise "
                         "--max_new_tokens")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_r and cfg.lora_alpha <= 0:
        raise UsageError(f"--lora_alpha must be > 0, got {cfg.lora_alpha}")
    if cfg.lora_r and cfg.fsdp:
        raise UsageError("--lora_r with --fsdp is not supported yet (PEFT adapters under FSDP2 "
                         "are untested here): use DDP for LoRA runs")
    _check_tensor_parallel(cfg)
    _check_threads(cfg.num_threads)
    _check_float16(cfg)
    if cfg.lora_r and cfg.lora_head and cfg.fp32_lm_head:
        raise UsageError("--fp32_lm_head cannot be combined with a LoRA adapter on the head "
                         "(--lora_head): use --no_lora_head, or drop --fp32_lm_head")
    if cfg.top_p > 1:
        raise UsageError(f"--top_p must be in (0, 1], got {cfg.top_p}")
    _check_dataset_flags(cfg)
    if not cfg.reward:
        raise UsageError("--reward needs at least one reward function")
    limit = cfg.max_unscored_steps  # a library caller may pass any object: say what it must be
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise UsageError("--max_unscored_steps must be a whole number of steps >= 0 "
                         f"(0 = never stop), got {limit!r}")
    if cfg.resume and cfg.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: continue the run in "
                         "--output_dir, or delete it and start again, not both")
    grad_filter_value(cfg.grad_filter)
    if cfg.model:  # paths are checked here, before torch and transformers are imported
        check_model_source(cfg.model)
    if cfg.dataset:
        check_dataset_source(cfg.dataset)
    if cfg.resume and cfg.resume not in ("auto", "last", "latest") and not os.path.exists(
            cfg.resume):
        raise MissingPathError(f"--resume {cfg.resume!r}: no such checkpoint file or run "
                               "directory (expected a step_*.pt file, a run directory, or 'auto')")
    _check_loss_params(cfg)
    return cfg


def _check_numbers(cfg: TrainConfig) -> None:
    """Every float flag finite (NaN passes every comparison: a NaN --top_p or --max_grad_norm
    ran on silently), and the ranges torch or transformers would reject with a traceback."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{f.name} must be a finite number, got {value}")
    if not MIN_TEMPERATURE <= cfg.temperature:
        raise UsageError(
            f"--temperature must be >= {MIN_TEMPERATURE:g}, got {cfg.temperature:g}: the logits "
            "are divided by it in float32 (sampling and loss), which overflows to inf and NaN "
            "for temperatures near 0, and below it sampling is greedy in effect")
    if not cfg.temperature <= MAX_TEMPERATURE:
        raise UsageError(
            f"--temperature must be <= {MAX_TEMPERATURE:g} (the valid range is "
            f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]), got {cfg.temperature:g}: the logits "
            "are divided by it, and above it sampling is uniform in effect (odds of at most "
            "1.01 across a logit spread of 100) and the loss' gradient, which shrinks as 1 / "
            "temperature, vanishes (from 3.4e38 up the temperature is inf in float32)")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise UsageError(f"--{name} must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.format_warmup_lr < 0:
        raise UsageError(f"--format_warmup_lr must be >= 0, got {cfg.format_warmup_lr}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise UsageError(f"--seed must be a whole number in [0, 2**63 - 1], got {cfg.seed}")


def thread_limit() -> tuple[int, str] | None:
    """(the most threads the system lets this user run, what sets it): the lower of the soft
    RLIMIT_NPROC (`ulimit -u`, which counts threads) and Linux's kernel.threads-max; None where
    neither is known."""
    limits = []
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append((soft, "threads per user (ulimit -u)"))
    except (ImportError, AttributeError, OSError, ValueError):  # not a Unix system
        pass
    try:
        with open("/proc/sys/kernel/threads-max") as f:
            limits.append((int(f.read()), "threads (kernel.threads-max)"))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def _check_threads(n: int | None) -> None:
    """--num_threads above the system's thread limit: torch accepts the number, and its OpenMP
    pool then fails creating the threads at the first parallel operation with a segmentation
    fault or an abort ("libgomp: Out of memory"), no Python error. Above the CPU cores it only
    runs slower (the threads take turns), so that is a warning (run_state.set_threads)."""
    limit = thread_limit()
    if n and limit is not None and n > limit[0]:
        raise UsageError(f"--num_threads {n} exceeds this system's limit of {limit[0]} "
                         f"{limit[1]}: torch would crash creating the threads. This process "
                         f"may use {usable_cores()} CPU cores: pass at most that, or 0 for "
                         "torch's default (one per core)")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else os.cpu_count())."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_float16(cfg: TrainConfig) -> None:
    """float16 weights that AdamW would train: its eps (1e-8) is 0 in float16, and torch's
    AdamW on a float16 parameter wrote -inf for a gradient of 1e-3 and NaN for a gradient of 0,
    so the first step's weights were NaN. LoRA adapters are float32 (PEFT's default)."""
    if cfg.model_dtype != "float16":
        return
    fix = ("use --model_dtype bfloat16, or float32 with --bf16 (mixed precision), or train "
           "float32 LoRA adapters (--lora_r)")
    if not cfg.lora_r:
        raise UsageError("--model_dtype float16 would train float16 weights with AdamW, whose "
                         f"eps (1e-8) is 0 in float16: the first step writes inf and NaN; {fix}")
    if not cfg.model and cfg.format_warmup_steps:
        raise UsageError("--model_dtype float16: the format warm-up (--format_warmup_steps "
                         f"{cfg.format_warmup_steps}) trains every float16 weight of the "
                         "embedded model with AdamW, whose eps (1e-8) is 0 in float16; pass "
                         "--format_warmup_steps 0, or --model_dtype bfloat16")


def _check_dataset_flags(cfg: TrainConfig) -> None:
    """The data flags that only a --dataset reads, given without one: the embedded task would
    run instead of what they name."""
    if cfg.dataset:
        return
    defaults = TrainConfig()
    for name in ("dataset_config", "split", "eval_split", "prompt_column", "answer_column"):
        if getattr(cfg, name) != getattr(defaults, name):
            raise UsageError(f"--{name} {getattr(cfg, name)!r} applies to a --dataset, and none "
                             "is given (the embedded arithmetic task would run instead): pass "
                             "--dataset, or leave out --" + name)


def _check_tensor_parallel(cfg) -> None:
    """--tp_size with the settings it does not support (the process count is checked at launch,
    `tensor_parallel.require`)."""
    tp = cfg.tp_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UsageError(f"--tp_size must be a whole number >= 1, got {tp!r}")
    if tp == 1:
        return
    for flag, on in (("--fsdp", cfg.fsdp), ("--lora_r", cfg.lora_r),
                     ("--fp32_lm_head", cfg.fp32_lm_head)):
        if on:
            raise UsageError(f"--tp_size {tp} with {flag} is not supported: tensor parallelism "
                             "runs transformers' plan on full-precision, adapter-free weights")


_LOSS_FLAGS = {"beta": "--beta", "epsilon_low": "--epsilon_low", "epsilon_high": "--epsilon_high",
               "delta": "--delta", "temperature": "--temperature", "loss_type": "--loss_type",
               "importance_sampling_level": "--importance_sampling_level",
               "max_completion_length": "--max_new_tokens", "entropy_coef": "--entropy_coef"}


LOCAL_DATASET_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def check_model_source(source: str, flag: str = "--model") -> None:
    """A path-like `source` must be a model directory; anything else is taken as a hub id."""
    local = os.path.exists(source)
    if local and not os.path.isdir(source):
        raise UsageError(f"{flag} {source!r} is a file; expected a model directory "
                         "(config.json, weights, tokenizer files) or a hub id")
    if not local and (source.startswith((".", "/", "~")) or source.count("/") > 1):
        raise MissingPathError(f"{flag} {source!r}: no such directory (expected a local model "
                               "directory or a hub id like 'Qwen/Qwen2.5-0.5B-Instruct')")


def saved_dataset_layout(path: str) -> str | None:
    """What `datasets`' save_to_disk wrote in directory `path`: "dict" (a DatasetDict: its
    dataset_dict.json and a directory per split), "dataset" (one Dataset: state.json beside the
    arrow files), or None (not such a directory)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return "dict"
    if os.path.isfile(os.path.join(path, "state.json")):
        return "dataset"
    return None


def check_dataset_source(name: str) -> None:
    """A path-like --dataset must be a file or a save_to_disk directory; anything else is taken
    as a hub dataset id."""
    if os.path.isfile(name):
        return
    if os.path.isdir(name):
        if saved_dataset_layout(name):
            return
        raise UsageError(f"--dataset {name!r} is a directory without the dataset_dict.json or "
                         "state.json that `datasets`' save_to_disk writes; expected such a "
                         "directory, a local .json/.jsonl/.csv/.parquet file or a hub dataset id")
    ext = os.path.splitext(name)[1].lower()
    if ext in LOCAL_DATASET_FORMATS or name.startswith((".", "/", "~")) or os.path.isdir(name):
        raise MissingPathError(f"--dataset {name!r}: no such file (expected a local "
                               ".json/.jsonl/.csv/.parquet file, a directory written by "
                               "`datasets`' save_to_disk, or a hub dataset id)")


def _check_loss_params(cfg: TrainConfig) -> None:
    """The loss' own validation (grpo_kernels.GRPOParams), its messages in flag names."""
    try:
        grpo_params(cfg)
    except ValueError as err:
        text = str(err)
        for param, flag in _LOSS_FLAGS.items():
            text = re.sub(rf"\b{param}\b", flag, text)
        raise UsageError(text) from err


def grad_filter_value(text: str | float | None) -> str | float | None:
    """--grad_filter as the loss takes it: None, "auto" or a float >= 0."""
    if text is None or text == "auto":
        return text
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise UsageError(f'--grad_filter must be "auto" or a finite number >= 0, got {text!r}')
    return value
