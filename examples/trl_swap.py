"""TRL's GRPOTrainer with grpo-kernels' fused loss: a one-import swap.

    python examples/trl_swap.py              # CPU, well under a minute, no downloads
    python examples/trl_swap.py --compare    # also train TRL's own trainer from the same seed
    python examples/trl_swap.py --padded     # keep TRL's padded batches (padding_free=False)

In the training code the only grpo-kernels line is the import of `GRPOTrainer` (the command
line lists TRL's loss types from grpo_kernels); the config, dataset, reward function and
training call are plain TRL. A tiny random Qwen2 model and a character-level tokenizer are
saved to a temporary directory first (TRL loads the policy, and the reference model for the KL
term, from that path).

With --compare the same run is repeated with `trl.GRPOTrainer`: the logged losses and the final
parameters agree to float32 precision (the sampled completions are the same, since neither
trainer draws random numbers outside generation).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import warnings

import datasets
import transformers
from datasets import Dataset
from transformers import PrinterCallback
from trl import GRPOConfig

from grpo_kernels.loss_specs import TRL_LOSS_TYPES
from grpo_kernels.trl import GRPOTrainer  # was: from trl import GRPOTrainer
from grpo_train.flags import Parser  # the flag convention of grpo-train and the benchmarks
from grpo_train.tiny import save_tiny_model

PAIRS = [(12, 30), (7, 5), (40, 2), (3, 3), (9, 9), (21, 21), (1, 8), (6, 4)]


def digits_reward(completions, **kwargs) -> list[float]:
    """A toy reward: the fraction of digits in the completion (conversational format)."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def train(trainer_cls, model_path: str, out_dir: str, opts: argparse.Namespace):
    """Train `opts.steps` optimizer steps with `trainer_cls`; returns the trainer."""
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"{a}+{b}"}] for a, b in PAIRS]})
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        gradient_accumulation_steps=2, generation_batch_size=16,  # 4 micro-batches per rollout
        loss_type=opts.loss_type, beta=opts.beta, learning_rate=1e-3, max_steps=opts.steps,
        logging_steps=1, save_strategy="no", disable_tqdm=True,
    )
    ours = {"padding_free": not opts.padded} if trainer_cls is GRPOTrainer else {}
    trainer = trainer_cls(model=model_path, reward_funcs=digits_reward, args=args,
                          train_dataset=dataset, **ours)
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; we print our own lines
    trainer.train()
    return trainer


def losses(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def positive_int(text: str) -> int:
    # TRL's max_steps reads 0 as one step and -1 as "train whole epochs"
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser("examples/trl_swap.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=3, help="optimizer steps (>= 1)")
    parser.add_argument("--loss_type", default="dapo", choices=TRL_LOSS_TYPES,
                        metavar="{" + ",".join(TRL_LOSS_TYPES) + "}", help="TRL's loss_type")
    parser.add_argument("--beta", type=finite_float, default=0.04, help="KL coefficient")
    parser.add_argument("--padded", action="store_true",
                        help="run TRL's padded batches, not packed rows (padding_free=False)")
    parser.add_argument("--compare", action="store_true",
                        help="also run trl.GRPOTrainer from the same seed and compare")
    return parser.parse_args(argv)


def main() -> None:
    opts = parse_args()
    # only this script's lines: no progress bars (weights, shards, dataset maps) or library
    # logging; transformers 5 deprecation notices about argument names TRL still uses
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_model(f"{tmp}/model")
        start = time.perf_counter()
        trainer = train(GRPOTrainer, f"{tmp}/model", f"{tmp}/out", opts)
        for log in trainer.state.log_history:
            if "loss" in log:  # rewards are logged on the steps that generate a new batch
                reward = f"{log['reward']:.3f}" if "reward" in log else "-"
                print(f"step {log['step']}: loss {log['loss']:+.4f}  kl {log['kl']:.5f}  "
                      f"entropy {log['entropy']:.3f}  reward {reward}")
        layout = f"{trainer._layout} rows"
        print(f"grpo-kernels trainer ({layout}): {trainer.state.global_step} steps in "
              f"{time.perf_counter() - start:.1f}s")
        if opts.compare:
            import trl

            stock = train(trl.GRPOTrainer, f"{tmp}/model", f"{tmp}/out_trl", opts)
            d_loss = max(abs(a - b) for a, b in zip(losses(trainer), losses(stock)))
            d_param = max((p - q).abs().max().item() for p, q in
                          zip(trainer.model.parameters(), stock.model.parameters()))
            print(f"vs trl.GRPOTrainer: max |loss diff| {d_loss:.2e}, "
                  f"max |parameter diff| {d_param:.2e}")
        print("done:", trainer.state.global_step, "steps")


if __name__ == "__main__":
    main()
