"""`python -m grpo_train` / `grpo-train`: parse the configuration, train, report.

With no arguments it runs the embedded default (tiny model, generated arithmetic task, CPU).
Exit status: 0 when training finished; 2 for a bad argument or input (one line
`grpo-train: error: ...` on stderr; `--debug` shows the traceback); 130 when it was interrupted
(after saving a checkpoint).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .flags import run_cli

    return run_cli("grpo-train", lambda: _main(argv), argv)


def _main(argv: list[str] | None) -> int:
    from . import parse_config, train  # the trainer loads after parsing: --help stays fast

    result = train(parse_config(argv))
    history = result["eval_accuracy"]
    if history and not result["interrupted"] and result["main_process"]:
        first, last = min(history), max(history)
        print(f"held-out accuracy: step {first} {history[first]:.3f} -> "
              f"step {last} {history[last]:.3f}", flush=True)
    return 130 if result["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
