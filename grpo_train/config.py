"""The trainer's configuration: one commented dataclass, command-line flags generated from it, and
an optional YAML/JSON file.

Precedence: dataclass defaults < `--config FILE` < explicit command-line flags.
Every field `foo_bar` is the flag `--foo_bar` (also accepted: `--foo-bar`). Booleans take
`--flag` / `--no_flag` (or `--flag true|false`); list fields take several values
(`--reward accuracy format:0.2`). `--help` is built from the comments of TrainConfig.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import os
import re
import tokenize
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .cli import BoolFlag, MissingPathError, Parser, UsageError, VersionAction


@dataclass
class TrainConfig:
    """Every setting of a run. Fields marked "auto" default to None and are resolved by
    `resolve_auto` (see AUTO): one value for the embedded tiny run, TRL's for --model.

    The comments are the documentation: `--help` shows each field's comment block and trailing
    comment as its description, under its "# ---- topic" heading."""

    # ---- general -----------------------------------------------------------------------------
    seed: int = 0  # seeds the embedded model, the task split, prompt order and sampling

    # ---- model -------------------------------------------------------------------------------
    # Local directory or hub id of any AutoModelForCausalLM (+ its tokenizer and chat template).
    # "" = the embedded default: a tiny randomly initialised causal LM and a character tokenizer.
    model: str = ""
    revision: str | None = None  # hub revision of --model
    # Weights dtype. float32 + --bf16 = mixed precision (float32 master weights, bf16 compute);
    # bfloat16 = pure-bf16 training, the least memory.
    model_dtype: str = "float32"
    trust_remote_code: bool = False  # run the model repository's own Python code
    tiny_arch: str = "qwen2"  # embedded model's architecture
    tiny_hidden_size: int = 64  # embedded model width
    tiny_layers: int = 2  # embedded model depth
    # Standard deviation of the embedded model's random initial weights (transformers'
    # initializer_range, 0.02 by default). At 0.1, about 1/sqrt(width), the embedded run starts
    # learning after 10-25 steps; at 0.02 its output ignored the prompt for 20-60 steps.
    tiny_init_std: float = 0.1
    # Supervised warm-up of the embedded model before step 0 on *random* answers: it learns the
    # output format (digits, then EOS), never which answer is right. 0 disables it.
    format_warmup_steps: int = 30
    format_warmup_lr: float = 3e-3  # learning rate of the format warm-up
    # LoRA rank (PEFT, `pip install grpo-kernels[lora]`); 0 = train every weight. With r > 0
    # only the adapters train; the reference policy (beta > 0) is the model without them.
    lora_r: int = 0
    lora_alpha: float = 32.0  # LoRA scale numerator: adapters are scaled by alpha / r
    lora_dropout: float = 0.0  # dropout on the LoRA branch's input
    # Put an adapter on the output head too: the fused loss trains it without a merged head
    lora_head: bool = True
    # Keep the output head (lm_head) in float32 while the rest runs in bf16/fp16 (TRL's
    # cast_lm_head_to_fp32): the kernels take the 16-bit hidden states with the fp32 head
    fp32_lm_head: bool = False

    # ---- data --------------------------------------------------------------------------------
    # "" = the embedded arithmetic task (generated, no download); else a local
    # .json/.jsonl/.csv/.parquet file or a hub dataset id (loaded with `datasets`).
    dataset: str = ""
    dataset_config: str | None = None  # hub dataset configuration name (e.g. "main" for gsm8k)
    split: str = "train"  # training split of a hub dataset
    eval_split: str | None = None  # held-out split; none = hold out eval_size training rows
    prompt_column: str = "question"  # text prompt, or a list of chat messages
    answer_column: str = "answer"  # ground truth ("" = none); GSM8K "... #### 42" -> "42"
    system_prompt: str | None = None  # prepended as a system message when the template has one
    # Held-out prompts for eval (0 = none). auto: all of the embedded task's held-out problems
    # (61, see task_eval_fraction); the first 200 rows of --eval_split; else min(200, 10% of the
    # dataset's rows) taken out of training (none under 10 rows). A number N: the first N of
    # those, or N rows taken out of training.
    eval_size: int | None = None
    max_prompt_length: int | None = None  # keep the last N prompt tokens (none: no limit)
    # Embedded task: sums of this many digits ("2+0+1+2+1"). Five digits 0-2 give 243 problems
    # whose sums 0-10 are all single digits but 10, so every answer is common enough to learn.
    task_terms: int = 5
    task_max_operand: int = 2  # embedded task: each digit is in [0, this]
    task_eval_fraction: float = 0.25  # embedded task: share of the problems held out for eval

    # ---- rewards -----------------------------------------------------------------------------
    # Built-in "accuracy" / "format", or "module:function" / "path/file.py:function" with TRL's
    # signature f(prompts, completions, **columns) -> list[float | None]; ":weight" appended
    # scales it (default 1). The step's reward is the weighted sum.
    reward: list[str] = field(default_factory=lambda: ["accuracy"])

    # ---- generation --------------------------------------------------------------------------
    num_prompts: int | None = None  # P: prompts per step, over all processes
    num_generations: int = 8  # G: completions per prompt (a group); must be >= 2
    max_new_tokens: int | None = None  # completion length cap
    min_new_tokens: int = 0  # EOS is suppressed before this many tokens (benchmarks: fixed length)
    temperature: float = 1.0  # sampling temperature, also applied to the loss' log-probs
    top_p: float = 1.0  # nucleus sampling: keep the smallest token set with this probability
    top_k: int = 0  # sample among the k likeliest tokens; 0 = no top-k filtering
    mask_truncated_completions: bool = False  # completions without EOS get no loss

    # ---- loss: TRL's names and defaults unless noted -------------------------------------------
    loss: str = "fused"  # "fused" (hidden states, no logits) | "reference" (materialized logits)
    loss_type: str = "dapo"  # how token losses are normalized (see docs/semantics.md)
    # KL weight; > 0 loads a frozen reference model, 0 loads none. The embedded run needs it:
    # anchored to the warm-up policy, the tiny model keeps exploring instead of collapsing onto
    # the most frequent answer (0.3 learned faster and more reliably than 0.1 there).
    beta: float | None = None
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip (none = epsilon)
    delta: float | None = None  # two-sided clipping cap on the ratio
    importance_sampling_level: str = "token"  # "sequence" = GSPO
    scale_rewards: str = "group"  # advantages divided by the std of the group, the batch, or not
    entropy_coef: float = 0.0  # loss -= entropy_coef x mean token entropy
    # Optimizer steps per generation batch (> 1 computes old log-probs; the ratio is clipped).
    # Reusing each batch four times is what makes the embedded run learn in minutes.
    num_iterations: int | None = None
    backend: str = "auto"  # fused-loss kernels: auto = Triton on CUDA; torch = chunked PyTorch
    # Gradient filtering in the Triton backward: none = exact; "auto" (2^-12 in bf16) or a number
    # skips vocabulary tiles whose d logits are all below it (approximate, faster on peaked
    # softmaxes; see docs/internals.md, "Gradient filtering").
    grad_filter: str | None = None

    # ---- optimization ------------------------------------------------------------------------
    steps: int | None = None  # generation steps (each does num_iterations optimizer steps)
    learning_rate: float | None = None  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.99  # AdamW beta2
    lr_scheduler: str = "constant"  # learning-rate schedule after the warm-up
    lr_warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    max_grad_norm: float = 1.0  # gradient clipping; 0 disables it
    # Sequences per forward/backward; 0 = the whole per-process batch
    micro_batch_size: int | None = None
    bf16: bool = False  # bfloat16 autocast (with float32 weights: mixed precision)
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory)

    # ---- logging and evaluation -------------------------------------------------------------
    eval_every: int = 25  # held-out eval every N steps (also at step 0 and at the end); 0 = off
    eval_batch_size: int = 256  # prompts per greedy generation call in eval
    progress: bool = True  # tqdm progress bar
    plot: bool = True  # write OUTPUT_DIR/curves.png at the end (needs matplotlib)

    # ---- checkpoints and output -------------------------------------------------------------
    # Where the run writes metrics.jsonl, checkpoints/, initial_model/, final_model/, curves.png.
    # A directory holding files is refused unless --resume or --overwrite is given.
    output_dir: str = "runs/default"
    # Delete the previous run's files in OUTPUT_DIR first (metrics, checkpoints, models, plot),
    # so that everything in it belongs to this run
    overwrite: bool = False
    # Continue from a checkpoint file, a run directory (its latest checkpoint), or "auto" (the
    # latest in OUTPUT_DIR, or a fresh start when OUTPUT_DIR holds no run yet)
    resume: str | None = None
    save_every: int = 100  # checkpoint every N steps (and on Ctrl-C and at the end); 0 = off
    keep_checkpoints: int = 2  # older checkpoints are deleted after a new one is safely written
    save_final_model: bool = True  # save_pretrained() to OUTPUT_DIR/final_model at the end

    # ---- distributed: several processes with `accelerate launch -m grpo_train ...` (DDP) ------
    # Shard parameters, gradients and AdamW state over the processes (PyTorch FSDP2) instead of
    # replicating them (DDP); launch with accelerate launch / torchrun as for DDP
    fsdp: bool = False
    device: str = "auto"  # auto = cuda when available
    # torch CPU threads; 0 = torch's default (one per core). The embedded model is too small
    # to gain from more: on a 2-core CPU with other processes busy, two threads ran it 3-5x
    # slower than one.
    num_threads: int | None = None


# (embedded tiny run, pretrained --model) values of the "auto" (None) fields.
AUTO = {
    "steps": (75, 200),
    "num_prompts": (64, 16),
    "max_new_tokens": (3, 256),
    "beta": (0.3, 0.0),
    "num_iterations": (4, 1),
    "learning_rate": (1e-3, 1e-6),
    "micro_batch_size": (0, 8),
    "num_threads": (1, 0),
}

# Fields whose "auto" (None) is resolved later, from the data: their --help default.
RESOLVED_LATER = {"eval_size": "auto"}

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
    auto = name in AUTO or name in RESOLVED_LATER

    def convert(text: str):
        if optional and text.lower() in (("none", "null", "auto") if auto else ("none", "null")):
            return None
        return base(text)

    convert.__name__ = getattr(base, "__name__", name)  # argparse: "invalid int value: 'x'"
    return convert


# ---- --help from the comments above ----------------------------------------------------------

_HEADING = re.compile(r"^-{3,}\s*(.*?)\s*-*$")  # "# ---- loss: TRL's names ------" -> topic


def field_docs() -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """({field: its comments as one text}, [(topic heading, [fields])]) read from this file's
    TrainConfig source: the comment lines right above a field plus its trailing comment."""
    source = Path(__file__).read_text()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    first, last = cls.body[0].end_lineno, cls.end_lineno  # after the docstring
    comments = {}  # line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and first < tok.start[0] <= last:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    fields_at = {n.lineno: n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    docs: dict[str, str] = {}
    topics: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    for line in range(first + 1, last + 1):
        name, text = fields_at.get(line), comments.get(line)
        if name is None and text is not None:
            heading = _HEADING.match(text)
            if heading:
                topics.append((heading.group(1), []))
                pending = []
            else:
                pending.append(text)
        elif name is not None:
            docs[name] = " ".join(pending + ([text] if text else []))
            topics[-1][1].append(name)
            pending = []
        else:  # a blank line ends a comment block
            pending = []
    return docs, topics


def _default_text(name: str, default) -> str:
    if name in AUTO:
        embedded, pretrained = AUTO[name]
        return f"default: {embedded} for the embedded run, {pretrained} with --model"
    if name in RESOLVED_LATER:
        return f"default: {RESOLVED_LATER[name]}"
    if isinstance(default, bool):
        return f"default: {'on' if default else 'off'}"
    if default is None:
        return "default: none"
    if isinstance(default, list):
        return f"default: {' '.join(default)}"
    return 'default: ""' if default == "" else f"default: {default}"


_METAVARS = {"model": "DIR|HUB_ID", "dataset": "FILE|HUB_ID", "output_dir": "DIR",
             "resume": "PATH|auto", "grad_filter": "auto|X|none", "revision": "REV",
             "dataset_config": "NAME", "split": "NAME", "eval_split": "NAME",
             "prompt_column": "NAME", "answer_column": "NAME"}


def _metavar(name: str, tp) -> str:
    if name in _METAVARS:
        return _METAVARS[name]
    if name in CHOICES:
        return "{" + "|".join(CHOICES[name]) + "}"
    if name in RESOLVED_LATER:
        return "N|auto"
    base, optional = _scalar_type(tp)
    word = {int: "N", float: "X"}.get(base, "TEXT")
    return f"{word}|none" if optional and base is not str else word


def package_version() -> str:
    """grpo_kernels.__version__: the version of the code that runs (imports torch)."""
    import grpo_kernels

    return grpo_kernels.__version__


def build_parser() -> Parser:
    docs, topics = field_docs()
    parser = Parser(
        "grpo-train",
        usage="grpo-train [--config FILE] [--FIELD VALUE ...]",
        description="Compact GRPO trainer on grpo_kernels' fused loss. With no arguments it "
        "trains a tiny model\non a generated arithmetic task (CPU, about a minute and a half).\n\n"
        "Every flag is also accepted with hyphens (--num-generations); booleans take --flag / "
        "--no_flag.\nPrecedence: the defaults below < --config FILE < flags on the command "
        "line. Exit status: 0 done,\n2 bad arguments or inputs (one line on stderr), "
        "130 interrupted (a checkpoint was saved).",
    )
    general = parser.add_argument_group("general")
    general.add_argument("--config", metavar="FILE",
                         help="YAML or JSON file of the settings below (field: value)")
    general.add_argument("--debug", action="store_true",
                         help="show the Python traceback of an error instead of one line")
    general.add_argument("--version", action=VersionAction, version=package_version,
                         help="print the version of grpo-kernels (this trainer's package) and exit")
    defaults, types = TrainConfig(), _field_types()
    for topic, names in topics:
        title, _, about = topic.partition(": ")  # "loss: TRL's names ..." -> title, description
        group = general if title == "general" else parser.add_argument_group(title, about or None)
        for name in names:
            tp, default = types[name], getattr(defaults, name)
            help_text = f"{docs[name]} ({_default_text(name, default)})".lstrip()
            help_text = help_text.replace("%", "%%")  # argparse formats help with %
            if tp is bool:
                group.add_argument(f"--{name}", action=BoolFlag, dest=name,
                                   default=argparse.SUPPRESS, help=help_text)
            elif typing.get_origin(tp) is list:
                group.add_argument(f"--{name}", dest=name, nargs="+", metavar="SPEC",
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(f"--{name}", dest=name, type=_converter(name, tp),
                                   choices=CHOICES.get(name), metavar=_metavar(name, tp),
                                   default=argparse.SUPPRESS, help=help_text)
    return parser


# ---- config files, auto values, validation --------------------------------------------------


def _coerce(name: str, value, tp, where: str):
    """A config-file value as the field's type (YAML/JSON already typed it; ints may be
    floats; strings are converted as on the command line)."""
    base, optional = _scalar_type(tp)
    if typing.get_origin(tp) is list:
        value = [value] if isinstance(value, str) else value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    elif value is None:
        if optional:
            return None
    elif isinstance(value, bool):
        if base is bool:
            return value
    elif base is str:
        return str(value)
    elif isinstance(value, base) or (base is float and isinstance(value, int)):
        return base(value)
    elif isinstance(value, str):
        try:
            return _str2bool(value) if base is bool else _converter(name, tp)(value)
        except ValueError:
            pass
    kind = "a list of strings" if typing.get_origin(tp) is list else base.__name__
    raise UsageError(f"{where}: {name} must be {kind}, got {value!r}")


def _str2bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return low in ("1", "true", "yes", "on")
    raise ValueError(f"expected true/false, got {text!r}")


def load_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise MissingPathError(f"--config {path!r}: no such file (expected a YAML or JSON file "
                               "of TrainConfig fields)")
    try:
        with open(path) as fh:
            if path.endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(fh) or {}
            else:
                data = json.load(fh)
    except Exception as err:  # noqa: BLE001 - OSError, JSON's ValueError, yaml.YAMLError
        raise UsageError(f"--config {path!r} could not be read as YAML/JSON: {err}") from err
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must hold a mapping of TrainConfig fields")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UsageError(f"--config {path!r}: unknown fields {unknown}; known: {sorted(names)}")
    types = _field_types()
    return {k: _coerce(k, v, types[k], f"--config {path!r}") for k, v in data.items()}


def resolve_auto(cfg: TrainConfig) -> TrainConfig:
    """Fill the "auto" (None) fields for the embedded run or a pretrained --model."""
    which = 1 if cfg.model else 0
    return dataclasses.replace(cfg, **{k: v[which] for k, v in AUTO.items()
                                       if getattr(cfg, k) is None})


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
    ("tiny_init_std", 0, True),
]


def validate(cfg: TrainConfig) -> TrainConfig:
    """Clear errors for settings that cannot work, before anything is loaded (after
    `resolve_auto`). Raises UsageError naming the flag."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise UsageError(f"--{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if cfg.num_generations < 2:
        raise UsageError(
            f"--num_generations must be >= 2 (group normalization needs at least two "
            f"completions per prompt), got {cfg.num_generations}"
        )
    for name, low, strict in _LOWER_BOUNDS:
        value = getattr(cfg, name)
        if value is not None and (value <= low if strict else value < low):
            raise UsageError(f"--{name} must be {'>' if strict else '>='} {low}, got {value}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_r and cfg.lora_alpha <= 0:
        raise UsageError(f"--lora_alpha must be > 0, got {cfg.lora_alpha}")
    if cfg.lora_r and cfg.fsdp:
        raise UsageError("--lora_r with --fsdp is not supported yet (PEFT adapters under FSDP2 "
                         "are untested here): use DDP for LoRA runs")
    if cfg.lora_r and cfg.lora_head and cfg.fp32_lm_head:
        raise UsageError("--fp32_lm_head cannot be combined with a LoRA adapter on the head "
                         "(--lora_head): use --no_lora_head, or drop --fp32_lm_head")
    if cfg.top_p > 1:
        raise UsageError(f"--top_p must be in (0, 1], got {cfg.top_p}")
    if not cfg.reward:
        raise UsageError("--reward needs at least one reward function")
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


_LOSS_FLAGS = {"beta": "--beta", "epsilon_low": "--epsilon", "epsilon_high": "--epsilon_high",
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


def check_dataset_source(name: str) -> None:
    """A path-like --dataset must be a file; anything else is taken as a hub dataset id."""
    if os.path.isfile(name):
        return
    ext = os.path.splitext(name)[1].lower()
    if ext in LOCAL_DATASET_FORMATS or name.startswith((".", "/", "~")) or os.path.isdir(name):
        raise MissingPathError(f"--dataset {name!r}: no such file (expected a local "
                               ".json/.jsonl/.csv/.parquet file or a hub dataset id)")


def _check_loss_params(cfg: TrainConfig) -> None:
    """The loss' own validation (grpo_kernels.GRPOParams), its messages in flag names."""
    from grpo_kernels.params import GRPOParams

    try:
        GRPOParams(beta=cfg.beta, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                   delta=cfg.delta, temperature=cfg.temperature, loss_type=cfg.loss_type,
                   importance_sampling_level=cfg.importance_sampling_level,
                   max_completion_length=cfg.max_new_tokens, entropy_coef=cfg.entropy_coef)
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


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from defaults, then `--config FILE`, then the other flags."""
    args = vars(build_parser().parse_args(argv))
    args.pop("debug", None)
    values: dict = {}
    path = args.pop("config", None)
    if path:
        values.update(load_config_file(path))
    values.update(args)
    return validate(resolve_auto(TrainConfig(**values)))
