"""`python -m grpo_train` / `grpo-train`: parse the configuration, train, report.

With no arguments it runs the embedded default (tiny model, generated arithmetic task, CPU).
Exit status: 0 when training finished, 130 when it was interrupted (after saving a checkpoint).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .config import parse_config

    cfg = parse_config(argv)
    from .trainer import train  # imported after argument parsing: --help stays fast

    result = train(cfg)
    history = result["eval_accuracy"]
    if history and not result["interrupted"] and result["main_process"]:
        first, last = min(history), max(history)
        print(f"held-out accuracy: step {first} {history[first]:.3f} -> "
              f"step {last} {history[last]:.3f}", flush=True)
    return 130 if result["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
