"""The trainer's configuration: `TrainConfig`, one dataclass whose field metadata holds each
setting's --help text, as in TRL's GRPOConfig (so transformers' HfArgumentParser can parse it
too); `TOPICS`, the groups of --help; the "auto" values and the learning-rate schedule.
`grpo_params` turns a TrainConfig into the loss' GRPOParams. Validation with errors that name
the flag is in `checks.py`, which imports this module (never the reverse)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from grpo_kernels.params import GRPOParams


def option(default, help: str):
    """A TrainConfig field: its default and its --help text (in `metadata["help"]`, where
    HfArgumentParser looks for it too)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Every setting of a run; each field is the flag of its name. `metadata["help"]` is the
    field's --help text (`cli.py` adds its default, and groups the fields by `TOPICS`). Fields
    whose default is "auto" hold None until `resolve_auto` (see AUTO): one value for the embedded
    tiny run, TRL's for --model."""

    seed: int = option(0, "seeds the embedded model, the LoRA adapters, the task split, prompt "
                          "order and sampling")

    model: str = option("",
        "Local directory or hub id of any AutoModelForCausalLM (+ its tokenizer and chat "
        "template). \"\" = the embedded default: a tiny randomly initialised causal LM and a "
        "character tokenizer.")
    revision: str | None = option(None, "hub revision of --model")
    model_dtype: str = option("float32",
        "Weights dtype. float32 + --bf16 = mixed precision (float32 master weights, bf16 "
        "compute); bfloat16 = pure-bf16 training, the least memory; float16 = LoRA adapters "
        "only (AdamW cannot train float16 weights).")
    trust_remote_code: bool = option(False, "run the model repository's own Python code")
    tiny_arch: str = option("qwen2", "embedded model's architecture")
    tiny_hidden_size: int = option(64, "embedded model width")
    tiny_layers: int = option(2, "embedded model depth")
    tiny_init_std: float = option(0.1,
        "Standard deviation of the embedded model's random initial weights (transformers' "
        "initializer_range, 0.02 by default). At 0.1, about 1/sqrt(width), the embedded run "
        "starts learning after 10-25 steps; at 0.02 its output ignored the prompt for 20-60 "
        "steps.")
    format_warmup_steps: int = option(30,
        "Supervised warm-up of the embedded model before step 0 on *random* answers: it learns "
        "the output format (digits, then EOS), never which answer is right. 0 disables it.")
    format_warmup_lr: float = option(3e-3, "learning rate of the format warm-up")
    lora_r: int = option(0,
        "LoRA rank (PEFT, `pip install grpo-kernels[lora]`); 0 = train every weight. With r > 0"
        " only the adapters train; the reference policy (beta > 0) is the model without them.")
    lora_alpha: float = option(32.0, "LoRA scale numerator: adapters are scaled by alpha / r")
    lora_dropout: float = option(0.0, "dropout on the LoRA branch's input")
    lora_head: bool = option(True,
        "Put an adapter on the output head too: the fused loss trains it without a merged head")
    fp32_lm_head: bool = option(False,
        "Keep the output head (lm_head) in float32 while the rest runs in bf16/fp16 (TRL's "
        "cast_lm_head_to_fp32): the kernels take the 16-bit hidden states with the fp32 head")

    dataset: str = option("",
        "\"\" = the embedded arithmetic task (generated, no download); else a local "
        ".json/.jsonl/.csv/.parquet file, a `datasets` save_to_disk directory, or a hub dataset "
        "id (loaded with `datasets`).")
    dataset_config: str | None = option(None,
        "hub dataset configuration name (e.g. \"main\" for gsm8k)")
    split: str = option("train", "training split of a hub dataset or a saved DatasetDict")
    eval_split: str | None = option(None,
        "held-out split; none = hold out eval_size training prompts")
    prompt_column: str = option("question", "text prompt, or a list of chat messages")
    answer_column: str = option("answer",
        "ground truth (\"\" = none); GSM8K \"... #### 42\" -> \"42\"")
    system_prompt: str | None = option(None,
        "prepended as a system message when the template has one")
    eval_size: int | None = option(None,
        "Held-out prompts for eval (0 = none). auto: all of the embedded task's held-out "
        "problems (61, see task_eval_fraction); the first 200 rows of --eval_split; else "
        "min(200, 10%% of the dataset's distinct prompts) taken out of training (none under 10). "
        "A number N: the first N of those, or N distinct prompts (every row of each) taken out "
        "of training.")
    max_prompt_length: int | None = option(None, "keep the last N prompt tokens (none: no limit)")
    task_terms: int = option(5,
        "Embedded task: sums of this many digits (\"2+0+1+2+1\"). Five digits 0-2 give 243 "
        "problems whose sums 0-10 are all single digits but 10, so every answer is common "
        "enough to learn.")
    task_max_operand: int = option(2, "embedded task: each digit is in [0, this]")
    task_eval_fraction: float = option(0.25,
        "embedded task: share of the problems held out for eval")

    reward: list[str] = field(default_factory=lambda: ["accuracy"], metadata={
        "help": 'Built-in "accuracy" / "format", or "module:function" / "path/file.py:function" '
                "with TRL's signature f(prompts, completions, **columns) -> list[float | None], "
                "called with keywords as TRL calls it; "
                "\":weight\" appended scales it (default 1). The step's reward is the weighted "
                "sum."})
    max_unscored_steps: int = option(3,
        "Stop the run (exit status 2, an error naming each reward function's failure) after "
        "this many consecutive steps in which no completion was scored: every function raised "
        "or returned None, NaN or inf. The last checkpoint written before them is kept. 0 = "
        "never stop.")

    num_prompts: int | None = option(None, "P: prompts per step, over all processes")
    num_generations: int = option(8, "G: completions per prompt (a group); must be >= 2")
    max_new_tokens: int | None = option(None, "completion length cap")
    min_new_tokens: int = option(0,
        "EOS is suppressed before this many tokens (benchmarks: fixed length)")
    temperature: float = option(1.0,
        "sampling temperature (>= 1e-4), also applied to the loss' log-probs")
    top_p: float = option(1.0,
        "nucleus sampling: keep the smallest token set with this probability")
    top_k: int = option(0, "sample among the k likeliest tokens; 0 = no top-k filtering")
    mask_truncated_completions: bool = option(False, "completions without EOS get no loss")
    generation: str = option("auto",
        "How completions are generated: \"continuous\" = transformers' continuous batching (paged"
        " attention: a finished completion leaves the batch and costs nothing more); \"padded\" ="
        " model.generate on the left-padded batch (every row runs until the longest ends); "
        "\"static\" = model.generate with a static KV cache and its decode step compiled "
        "(--static_compile; CUDA graphs on a GPU); \"auto\" = the first that runs of the rule "
        "for this device (grpo_train.generation.GENERATION_RULES: padded on CPU; static, "
        "then padded on CUDA). Set-ups a path cannot serve (--fsdp, ...) run padded; the log "
        "names the path that ran and why (docs/trainer.md, Generation paths).")
    static_compile: bool = option(True,
        "With --generation static: compile the decode step with torch.compile (mode "
        "reduce-overhead: CUDA graphs on a GPU; on a CPU it compiles too, slowly). Off: the "
        "static cache without compiling.")

    loss: str = option("fused",
        "\"fused\" (hidden states, no logits) | \"reference\" (materialized logits)")
    loss_type: str = option("dapo", "how token losses are normalized (see docs/semantics.md)")
    beta: float | None = option(None,
        "KL weight; > 0 loads a frozen reference model, 0 loads none. The embedded run needs "
        "it: anchored to the warm-up policy, the tiny model keeps exploring instead of "
        "collapsing onto the most frequent answer (0.3 learned faster and more reliably than "
        "0.1 there).")
    epsilon_low: float = option(0.2,
        "lower clip: ratio >= 1 - epsilon_low (TRL's GRPOConfig calls it epsilon)")
    epsilon_high: float | None = option(None, "upper clip (none = epsilon_low)")
    delta: float | None = option(None, "two-sided clipping cap on the ratio")
    use_bias_correction_kl: bool | None = option(None,
        "the k3 KL times the importance ratio, TRL's GRPOConfig default (off: the KL alone; "
        "with beta > 0 it changes the gradient even where the ratio is 1). The embedded run "
        "leaves it off: over seeds 0-5 it ended at held-out accuracy 0.93-1.0 without it, "
        "0.79-1.0 with it (docs/trainer.md).")
    importance_sampling_level: str = option("token", "\"sequence\" = GSPO")
    scale_rewards: str = option("group",
        "advantages divided by the std of the group, the batch, or not")
    entropy_coef: float = option(0.0, "loss -= entropy_coef x mean token entropy")
    num_iterations: int | None = option(None,
        "Optimizer steps per generation batch (> 1 computes old log-probs; the ratio is "
        "clipped). Reusing each batch four times is what makes the embedded run learn in "
        "minutes.")
    backend: str = option("auto",
        "fused-loss kernels: auto = Triton on CUDA, the chunked PyTorch path on CPU; triton; "
        "chunked")
    grad_filter: str | None = option(None,
        "Gradient filtering in the Triton backward: none = exact; \"auto\" (2^-12 in bf16) or a "
        "number skips vocabulary tiles whose d logits are all below it (approximate, faster on "
        "peaked softmaxes; see docs/internals.md, \"Gradient filtering\").")

    steps: int | None = option(None, "generation steps (each does num_iterations optimizer steps)")
    learning_rate: float | None = option(None, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.99, "AdamW beta2")
    lr_scheduler: str = option("constant", "learning-rate schedule after the warm-up")
    lr_warmup_steps: int = option(0, "linear learning-rate warm-up, in optimizer steps")
    max_grad_norm: float = option(1.0, "gradient clipping; 0 disables it")
    micro_batch_size: int | None = option(None,
        "Sequences per forward/backward; 0 = the whole per-process batch. Auto with --model: the "
        "largest divisor of the per-process batch up to 8 (one log line when below 8); a value "
        "given that does not divide the batch is an error.")
    max_tokens_per_microbatch: int = option(0,
        "Cut micro-batches by tokens instead (0 = off): as many whole sequences as fit N tokens"
        " (packed: real prompt + completion tokens; padded: rows x padded length); a longer "
        "sequence goes alone. Replaces --micro_batch_size.")
    padding_free: bool = option(True,
        "Pack each micro-batch's sequences end to end in one row (position_ids restarting, no "
        "attention mask): no forward or backward work on padding. Used where the model attends "
        "within the packed sequences (checked once at start; otherwise one line, and padded "
        "rows).")
    share_prompt: bool = option(True,
        "With --padding_free: the group's prompt once per micro-batch row, its completions after "
        "it under a mask that keeps siblings apart, so scoring and the loss compute the prompt "
        "once instead of G times (same loss and gradients). Used where the model takes a 4-D "
        "mask (sdpa, eager, flex attention; no sliding windows, no MoE; checked once at start, "
        "otherwise one line and packed rows).")
    attn_implementation: str = option("auto",
        "Attention implementation of the scoring and loss forwards (generation keeps the "
        "model's own): auto = the rule for this device and row layout "
        "(grpo_kernels.hf.ATTENTION_RULES; one log line names the choice and why); or sdpa, "
        "eager, flex_attention, torch_varlen_flash (PyTorch's bundled FlashAttention varlen "
        "kernel, packed rows on CUDA), refused with the reason where the model, the device or "
        "the row layout cannot take it.")
    bf16: bool = option(False, "bfloat16 autocast (with float32 weights: mixed precision)")
    gradient_checkpointing: bool = option(False, "recompute activations in backward (less memory)")

    eval_every: int = option(25,
        "held-out eval every N steps (also at step 0 and at the end); 0 = off")
    eval_batch_size: int = option(256, "prompts per greedy generation call in eval")
    progress: bool = option(True, "tqdm progress bar")
    plot: bool = option(True, "write OUTPUT_DIR/curves.png at the end (needs matplotlib)")

    output_dir: str = option("runs/default",
        "Where the run writes metrics.jsonl, checkpoints/, initial_model/, final_model/, "
        "curves.png. A directory holding files is refused unless --resume or --overwrite is "
        "given.")
    overwrite: bool = option(False,
        "Delete the previous run's files in OUTPUT_DIR first (metrics, checkpoints, models, "
        "plot), so that everything in it belongs to this run")
    resume: str | None = option(None,
        "Continue from a checkpoint file, a run directory (its latest checkpoint), or \"auto\" "
        "(the latest in OUTPUT_DIR, or a fresh start when OUTPUT_DIR holds no run yet)")
    save_every: int = option(100,
        "checkpoint every N steps (and on Ctrl-C and at the end); 0 = off")
    keep_checkpoints: int = option(2,
        "how many checkpoints to keep (0 = all): older ones are deleted after a new one is "
        "safely written")
    save_final_model: bool = option(True, "save_pretrained() to OUTPUT_DIR/final_model at the end")

    fsdp: bool = option(False,
        "Shard parameters, gradients and AdamW state over the processes (PyTorch FSDP2) instead"
        " of replicating them (DDP); launch with accelerate launch / torchrun as for DDP")
    tp_size: int = option(1,
        "Tensor parallelism over N processes (transformers' plan for the model; the output "
        "head split along the vocabulary, the fused loss never gathers its logits): launch with"
        " `torchrun --nproc_per_node N -m grpo_train --tp_size N`. N must equal the number of "
        "processes (no data parallelism beside it); not with --fsdp, --lora_r or --fp32_lm_head")
    device: str = option("auto", "auto = cuda when available")
    num_threads: int | None = option(None,
        "torch CPU threads; 0 = torch's default (one per core). The embedded model runs on one:"
        " two are faster on an idle 2-core CPU (45 vs 76 s) but 2.4x slower beside two busy "
        "processes (docs/trainer.md, Threads).")


# --help's topics, in TrainConfig's declaration order: each begins at the field named and runs up
# to the next one's first field, so a new field joins the topic it is declared among.
# "title: description" headings show the description under the title.
TOPICS = (
    ("seed", "general"),
    ("model", "model"),
    ("dataset", "data"),
    ("reward", "rewards"),
    ("num_prompts", "generation"),
    ("loss", "loss: TRL's names and defaults unless noted"),
    ("steps", "optimization"),
    ("eval_every", "logging and evaluation"),
    ("output_dir", "checkpoints and output"),
    ("fsdp", "distributed: several processes with `accelerate launch -m grpo_train ...` (DDP)"),
)

# (embedded tiny run, pretrained --model) values of the "auto" (None) fields.
AUTO = {
    "steps": (75, 200),
    "num_prompts": (64, 16),
    "max_new_tokens": (3, 256),
    "beta": (0.3, 0.0),
    "use_bias_correction_kl": (False, True),
    "num_iterations": (4, 1),
    "learning_rate": (1e-3, 1e-6),
    "micro_batch_size": (0, 8),
    "num_threads": (1, 0),
}

# AUTO fields that `resolve_auto` leaves None, resolved once the processes are known: the
# micro-batch size is a cap there (batching.batch_sizes takes the largest divisor of the
# per-process batch up to it).
AUTO_AT_SETUP = frozenset({"micro_batch_size"})

# Fields whose "auto" (None) is resolved later, from the data: their --help default.
RESOLVED_LATER = {"eval_size": "auto"}


def resolve_auto(cfg: TrainConfig) -> TrainConfig:
    """Fill the "auto" (None) fields for the embedded run or a pretrained --model (those of
    AUTO_AT_SETUP stay None: `auto_value` gives their cap)."""
    return dataclasses.replace(cfg, **{k: auto_value(cfg, k) for k in AUTO
                                       if getattr(cfg, k) is None and k not in AUTO_AT_SETUP})


def auto_value(cfg: TrainConfig, name: str):
    """AUTO's value of field `name` for this run: the embedded run's, or the one with --model."""
    return AUTO[name][1 if cfg.model else 0]


def lr_factor(cfg: TrainConfig):
    """The learning-rate multiplier per optimizer step (LambdaLR): a linear warm-up over
    --lr_warmup_steps, then constant, linear to 0 or cosine to 0 over the remaining steps."""
    total = max(cfg.steps * cfg.num_iterations, 1)

    def factor(s: int) -> float:
        if s < cfg.lr_warmup_steps:
            return (s + 1) / (cfg.lr_warmup_steps + 1)
        frac = (s - cfg.lr_warmup_steps) / max(total - cfg.lr_warmup_steps, 1)
        if cfg.lr_scheduler == "linear":
            return max(0.0, 1.0 - frac)
        if cfg.lr_scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0

    return factor


def grpo_params(cfg: TrainConfig) -> GRPOParams:
    """The loss' hyperparameters: TrainConfig's fields of GRPOParams' names, with the two that
    the trainer names otherwise (--max_new_tokens as dr_grpo's normalizer)."""
    return GRPOParams.from_config(cfg, max_completion_length=cfg.max_new_tokens)
