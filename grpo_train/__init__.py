"""grpo_train: a compact GRPO trainer on top of grpo_kernels' fused loss.

    python -m grpo_train                     # embedded default: tiny model, arithmetic, CPU
    python -m grpo_train --model DIR_OR_HUB_ID --dataset FILE_OR_HUB_ID ...

From Python: `train(TrainConfig(...))` or `main(["--steps", "10", ...])`.
"""

from .config import TrainConfig, parse_config

__all__ = ["TrainConfig", "parse_config", "train", "main"]


def train(cfg: TrainConfig) -> dict:
    from .trainer import train as _train  # heavy imports (transformers, accelerate) on demand

    return _train(cfg)


def main(argv: list[str] | None = None) -> int:
    from .__main__ import main as _main

    return _main(argv)
