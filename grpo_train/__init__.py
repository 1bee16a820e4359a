"""grpo_train: a compact GRPO trainer on top of grpo_kernels' fused loss.

    python -m grpo_train                     # embedded default: tiny model, arithmetic, CPU
    python -m grpo_train --model DIR_OR_HUB_ID --dataset FILE_OR_HUB_ID ...

From Python: `train(TrainConfig(...))` or `main(["--steps", "10", ...])`.
"""

from .checks import validate
from .cli import parse_config
from .config import TrainConfig, resolve_auto

__all__ = ["TrainConfig", "parse_config", "train", "main"]


def train(cfg: TrainConfig, phases=None, *, resolved: bool = False) -> dict:
    """Fill the "auto" fields and validate (one-line errors naming the flag) unless `resolved`
    says `parse_config` already did, refuse an output directory that holds another run, then
    train (`trainer.train`; `phases`: benchmark hooks)."""
    from .checkpoint import check_output_dir  # heavy imports (torch, transformers) on demand
    from .trainer import train as _train

    if not resolved:
        cfg = validate(resolve_auto(cfg))
    # never over another run, nor deleting what this one reads
    check_output_dir(cfg.output_dir, cfg.resume, cfg.overwrite,
                     {"--model": cfg.model, "--dataset": cfg.dataset})
    return _train(cfg, phases)


def main(argv: list[str] | None = None) -> int:
    from .__main__ import main as _main

    return _main(argv)
