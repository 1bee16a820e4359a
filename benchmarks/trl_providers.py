"""The TRL-based providers of benchmarks.trainer_step: TRL's own GRPOTrainer (`trl`) and
grpo-kernels' subclass of it (`trl-kernels`, packed rows unless --padding_free off), under TRL's
defaults and the same settings as grpo_train's providers.

Both run through one metered subclass that marks grpo_train's phases: generation = `_generate`,
scoring = the rest of `_generate_and_score_completions` (the reference model's log-probs when
beta != 0), loss = `training_step` after it, optimizer = from `on_pre_optimizer_step` to
`on_step_end` (TRL clips gradients just before, outside the phases).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from . import phases


def trainer_class(provider: str):
    """TRL's GRPOTrainer (`trl`) or grpo-kernels' subclass (`trl-kernels`)."""
    if provider == "trl":
        from trl import GRPOTrainer
    elif provider == "trl-kernels":
        from grpo_kernels.trl import GRPOTrainer
    else:
        raise ValueError(f"provider must be 'trl' or 'trl-kernels', got {provider!r}")
    return GRPOTrainer


def run_trl(args, model_dir: Path, prompt_text: str, workdir: Path, device,
            recorder, forcing, reward) -> tuple[list[dict], object, dict]:
    """Steps of a TRL-based trainer, timed and measured by a callback around each step; and
    what ran: its row layout, attention implementation and generation."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from grpo_train.logs import peak_memory_bytes
    from grpo_train.models import DTYPES

    cuda = device.type == "cuda"
    per_step = []

    class StepMeter(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()
            phases.begin_step()

        def on_pre_optimizer_step(self, *_, **__):
            phases.begin("optimizer")

        def on_step_end(self, *_, **__):
            phases.end("optimizer")
            phases.end_step()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - self.t0
            # this step's prompt + completion tokens (its generate call was the latest)
            tokens = args.num_generations * args.prompt_tokens + sum(forcing.history[-1])
            per_step.append(dict(step_time_s=elapsed, tokens_per_s=tokens / elapsed,
                                 peak_gib=peak_memory_bytes(device) / 2**30))

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.model_dtype])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    dataset = Dataset.from_list([{"prompt": prompt_text + "="}] * (args.warmup + args.steps + 1))
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.completion_tokens,
        gradient_accumulation_steps=1, max_steps=args.warmup + args.steps, learning_rate=1e-6,
        bf16=cuda and not args.no_bf16,
        gradient_checkpointing=not args.no_gradient_checkpointing, beta=args.beta,
        loss_type="dapo", temperature=1.0, top_p=1.0, top_k=0, logging_steps=10_000,
        disable_tqdm=True, report_to="none", save_strategy="no", use_cpu=not cuda,
        seed=args.seed, shuffle_dataset=False, dataloader_num_workers=0)
    base = trainer_class(args.provider)
    extra = dict(padding_free=args.padding_free == "on", share_prompt=args.share_prompt == "on"
                 ) if args.provider == "trl-kernels" else {}
    trainer = metered(base)(model=model, reward_funcs=reward, args=config,
                            train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[StepMeter()], **extra)
    if extra:  # the layout the subclass chose for this model (its one log line says why)
        print(f"trl-kernels: scoring and loss forwards run {trainer._layout} rows", flush=True)
    with phases.recording(recorder):
        trainer.train()
    ran = dict(row_layout=str(getattr(trainer, "_layout", "padded")),
               attention=trainer.model.config._attn_implementation,
               generation_path="TRL's model.generate (a prefill per row)")
    return per_step, recorder, ran


def metered(base):
    """`base` (a TRL GRPOTrainer class) with grpo_train's phase marks: generation and scoring
    run first (as in TRL, inside `_prepare_inputs`), then the rest of `training_step` is the loss
    phase."""

    class MeteredGRPOTrainer(base):
        _prepared = None

        def training_step(self, model, inputs, num_items_in_batch):
            model.train()  # as Trainer.training_step does before preparing inputs
            self._prepared = base._prepare_inputs(self, inputs)
            with phases.phase("loss"):
                return super().training_step(model, inputs, num_items_in_batch)

        def _prepare_inputs(self, inputs):
            prepared, self._prepared = self._prepared, None
            return prepared if prepared is not None else super()._prepare_inputs(inputs)

        def _generate_and_score_completions(self, inputs):
            with phases.phase("scoring"):
                return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts):
            with phases.phase("generation"):
                return super()._generate(prompts)

    return MeteredGRPOTrainer
