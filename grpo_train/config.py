"""The trainer's configuration: one commented dataclass, command-line flags generated from it, and
an optional YAML/JSON file.

Precedence: dataclass defaults < `--config FILE` < explicit command-line flags.
Every field `foo_bar` is the flag `--foo_bar` (also accepted: `--foo-bar`). Booleans take
`--flag` / `--no-flag` (or `--flag true|false`); list fields take several values
(`--reward accuracy format:0.2`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    """Every setting of a run. Fields marked "auto" default to None and are resolved by
    `resolve_auto`: the first value for the embedded tiny run, the second (TRL's) for --model."""

    # ---- model -------------------------------------------------------------------------------
    # Local directory or hub id of any AutoModelForCausalLM (+ its tokenizer and chat template).
    # "" = the embedded default: a tiny randomly initialised causal LM and a character tokenizer.
    model: str = ""
    tiny_arch: str = "qwen2"  # embedded model: "qwen2" | "llama"
    tiny_hidden_size: int = 64  # embedded model width
    tiny_layers: int = 2  # embedded model depth
    # Supervised warm-up of the embedded model before step 0 on *random* answers: it learns the
    # output format (digits, then EOS), never which answer is right. 0 disables it.
    format_warmup_steps: int = 60
    format_warmup_lr: float = 3e-3
    revision: str | None = None  # hub revision of --model
    # Weights dtype. float32 + --bf16 = mixed precision (float32 master weights, bf16 compute);
    # bfloat16 = pure-bf16 training, the least memory.
    model_dtype: str = "float32"
    trust_remote_code: bool = False

    # ---- data --------------------------------------------------------------------------------
    # "" = the embedded arithmetic task (generated, no download); else a local
    # .json/.jsonl/.csv/.parquet file or a hub dataset id (loaded with `datasets`).
    dataset: str = ""
    dataset_config: str | None = None  # hub dataset configuration name (e.g. "main" for gsm8k)
    split: str = "train"  # training split of a hub dataset
    eval_split: str | None = None  # held-out split; None = hold out `eval_size` training rows
    prompt_column: str = "question"  # text prompt, or a list of chat messages
    answer_column: str = "answer"  # ground truth ("" = none); GSM8K "... #### 42" -> "42"
    system_prompt: str | None = None  # prepended as a system message when the template has one
    eval_size: int = 200  # held-out prompts (embedded task: problems never seen in training)
    max_prompt_length: int | None = None  # keep the last N prompt tokens (None: no limit)
    task_terms: int = 4  # embedded task: sums of this many digits ("3+0+2+1")
    task_max_operand: int = 3  # embedded task: each digit is in [0, this]
    task_eval_fraction: float = 0.25  # embedded task: share of the problems held out for eval

    # ---- generation --------------------------------------------------------------------------
    num_prompts: int | None = None  # P: prompts per step, over all processes (auto: 64 | 16)
    num_generations: int = 8  # G: completions per prompt (a group); must be >= 2
    max_new_tokens: int | None = None  # completion length cap (auto: 4 | 256)
    min_new_tokens: int = 0  # EOS is suppressed before this many tokens (benchmarks: fixed length)
    temperature: float = 1.0  # sampling temperature, also applied to the loss' log-probs
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    mask_truncated_completions: bool = False  # completions without EOS get no loss

    # ---- rewards -----------------------------------------------------------------------------
    # Built-in "accuracy" / "format", or "module:function" / "path/file.py:function" with TRL's
    # signature f(prompts, completions, **columns) -> list[float | None]; ":weight" appended
    # scales it (default 1). The step's reward is the weighted sum.
    reward: list[str] = field(default_factory=lambda: ["accuracy"])

    # ---- loss (TRL names and defaults unless noted) --------------------------------------------
    loss: str = "fused"  # "fused" (hidden states, no logits) | "reference" (materialized logits)
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo
    # KL weight; > 0 loads a frozen reference model, 0 loads none. auto: 0.1 | 0.0. The embedded
    # run needs it: anchored to the warm-up policy, the tiny model keeps exploring instead of
    # collapsing onto the most frequent answer.
    beta: float | None = None
    epsilon: float = 0.2  # lower clip
    epsilon_high: float | None = None  # upper clip (None = epsilon)
    delta: float | None = None  # two-sided clipping cap
    importance_sampling_level: str = "token"  # "token" | "sequence" (GSPO)
    scale_rewards: str = "group"  # "group" | "batch" | "none"
    entropy_coef: float = 0.0
    # Optimizer steps per generation batch (> 1 computes old log-probs; the ratio is clipped).
    # auto: 4 | 1. Reusing each batch four times is what makes the embedded run learn in minutes.
    num_iterations: int | None = None
    backend: str = "auto"  # fused-loss kernels: "auto" | "triton" | "torch" (chunked PyTorch)
    # Gradient filtering in the Triton backward: None = exact; "auto" (2^-12 in bf16) or a number
    # skips vocabulary tiles whose d logits are all below it (approximate, faster on peaked
    # softmaxes; see README "Gradient filtering").
    grad_filter: str | None = None

    # ---- optimization ------------------------------------------------------------------------
    steps: int = 200  # generation steps (each does num_iterations optimizer steps)
    learning_rate: float | None = None  # AdamW (auto: 1e-3 | 1e-6)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    lr_scheduler: str = "constant"  # "constant" | "linear" | "cosine" (after the warm-up)
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0  # gradient clipping; 0 disables it
    # Sequences per forward/backward; 0 = the whole per-process batch (auto: 0 | 8)
    micro_batch_size: int | None = None
    bf16: bool = False  # bfloat16 autocast (with float32 weights: mixed precision)
    gradient_checkpointing: bool = False
    # Shard parameters, gradients and AdamW state over the processes (PyTorch FSDP2) instead of
    # replicating them (DDP); launch with accelerate launch / torchrun as for DDP
    fsdp: bool = False

    # ---- run ---------------------------------------------------------------------------------
    output_dir: str = "runs/default"
    seed: int = 0
    eval_every: int = 25  # held-out eval every N steps (also at step 0 and at the end); 0 = off
    eval_batch_size: int = 256
    save_every: int = 100  # checkpoint every N steps (and on Ctrl-C and at the end); 0 = off
    keep_checkpoints: int = 2  # older checkpoints are deleted after a new one is safely written
    resume: str | None = None  # checkpoint file, run directory, or "auto" (latest if any)
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    num_threads: int = 0  # torch CPU threads (0 = torch's default)
    progress: bool = True  # tqdm progress bar
    plot: bool = True  # write curves.png at the end (needs matplotlib)
    save_final_model: bool = True  # save_pretrained() to OUTPUT_DIR/final_model at the end


# (embedded tiny run, pretrained --model) values of the "auto" (None) fields.
AUTO = {
    "num_prompts": (64, 16),
    "max_new_tokens": (4, 256),
    "beta": (0.1, 0.0),
    "num_iterations": (4, 1),
    "learning_rate": (1e-3, 1e-6),
    "micro_batch_size": (0, 8),
}

CHOICES = {
    "tiny_arch": ("qwen2", "llama"),
    "model_dtype": ("float32", "bfloat16", "float16"),
    "loss": ("fused", "reference"),
    "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"),
    "importance_sampling_level": ("token", "sequence"),
    "scale_rewards": ("group", "batch", "none"),
    "backend": ("auto", "triton", "torch"),
    "lr_scheduler": ("constant", "linear", "cosine"),
    "device": ("auto", "cpu", "cuda"),
}


def _str2bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _field_types() -> dict[str, typing.Any]:
    return typing.get_type_hints(TrainConfig)


def _scalar_type(tp):
    """(python type, optional?) of an annotation like `int`, `float | None`, `list[str]`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return str, False
    if args:  # X | None
        return args[0], True
    return tp, False


def _converter(name: str, tp):
    base, optional = _scalar_type(tp)

    def convert(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        if base is bool:
            return _str2bool(text)
        return base(text)

    convert.__name__ = getattr(base, "__name__", name)
    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-train",
        description="Compact GRPO trainer on grpo_kernels' fused loss. With no arguments it "
        "trains a tiny model on a generated arithmetic task (CPU, a few minutes).",
    )
    parser.add_argument("--config", help="YAML or JSON file of TrainConfig fields")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        tp = _field_types()[f.name]
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        default = getattr(defaults, f.name)
        help_text = f"(default: {default!r})"
        if tp is bool:
            parser.add_argument(*flags, dest=f.name, nargs="?", const=True, type=_str2bool,
                                default=argparse.SUPPRESS, help=help_text)
            negations = {f"--no-{f.name}", f"--no-{f.name.replace('_', '-')}"}
            parser.add_argument(*sorted(negations), dest=f.name, action="store_false",
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif typing.get_origin(tp) is list:
            parser.add_argument(*flags, dest=f.name, nargs="+", default=argparse.SUPPRESS,
                                help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, type=_converter(f.name, tp),
                                choices=CHOICES.get(f.name), default=argparse.SUPPRESS,
                                help=help_text)
    return parser


def load_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config: no such file {path!r}")
    with open(path) as fh:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(fh) or {}
        else:
            data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of TrainConfig fields")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"--config {path!r}: unknown fields {unknown}; known: {sorted(names)}")
    return data


def resolve_auto(cfg: TrainConfig) -> TrainConfig:
    """Fill the "auto" (None) fields for the embedded run or a pretrained --model."""
    which = 1 if cfg.model else 0
    return dataclasses.replace(cfg, **{k: v[which] for k, v in AUTO.items()
                                       if getattr(cfg, k) is None})


def validate(cfg: TrainConfig) -> TrainConfig:
    """Clear errors for settings that cannot work, before anything is loaded (after
    `resolve_auto`)."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if cfg.num_generations < 2:
        raise ValueError(
            f"--num_generations must be >= 2 (group normalization needs at least two "
            f"completions per prompt), got {cfg.num_generations}"
        )
    if cfg.num_prompts < 1:
        raise ValueError(f"--num_prompts must be >= 1, got {cfg.num_prompts}")
    if cfg.max_new_tokens < 1 or cfg.steps < 0 or cfg.num_iterations < 1:
        raise ValueError("--max_new_tokens and --num_iterations must be >= 1, --steps >= 0")
    if cfg.micro_batch_size < 0:
        raise ValueError(f"--micro_batch_size must be >= 0, got {cfg.micro_batch_size}")
    if not cfg.reward:
        raise ValueError("--reward needs at least one reward function")
    grad_filter_value(cfg.grad_filter)
    return cfg


def grad_filter_value(text: str | float | None) -> str | float | None:
    """--grad_filter as the loss takes it: None, "auto" or a float >= 0."""
    if text is None or text == "auto":
        return text
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f'--grad_filter must be "auto" or a finite number >= 0, got {text!r}')
    return value


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from defaults, then `--config FILE`, then the other flags."""
    args = vars(build_parser().parse_args(argv))
    values: dict = {}
    path = args.pop("config", None)
    if path:
        values.update(load_config_file(path))
    values.update(args)
    return validate(resolve_auto(TrainConfig(**values)))
