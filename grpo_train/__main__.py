"""`python -m grpo_train` / `grpo-train`: parse the configuration, train, report.

With no arguments it runs the embedded default (tiny model, generated arithmetic task, CPU).
Exit status: 0 when training finished; 2 for a bad argument or input, or reward functions that
scored no completion for --max_unscored_steps steps in a row (one line `grpo-train: error: ...`
on stderr; `--debug` shows the traceback); 130 when it was interrupted (after saving a
checkpoint).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .flags import run_cli

    return run_cli("grpo-train", lambda: _main(argv), argv)


def _main(argv: list[str] | None) -> int:
    from . import parse_config, train  # the trainer loads after parsing: --help stays fast

    cfg = parse_config(argv)
    if _run_is_complete(cfg):
        return 0
    result = train(cfg, resolved=True)  # parse_config resolved and validated it
    _end_processes()
    history = result["eval_accuracy"]
    if history and not result["interrupted"] and result["main_process"]:
        _print_held_out(history)
    return 130 if result["interrupted"] else 0


def _end_processes() -> None:
    """Tear a multi-process run's process group down before the interpreter exits (the command
    line's run owns it): a gloo process group left to interpreter teardown can abort a process
    while a peer's last messages are in flight."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _print_held_out(history: dict) -> None:
    first, last = min(history), max(history)
    print(f"held-out accuracy: step {first} {history[first]:.3f} -> "
          f"step {last} {history[last]:.3f}", flush=True)


def _run_is_complete(cfg) -> bool:
    """--resume on a run whose latest checkpoint is at --steps already: say so (and its held-out
    accuracy) without loading a model or writing anything; settings that differ from the
    checkpoint's run are refused as a resume that trains on refuses them."""
    if not cfg.resume:
        return False
    from pathlib import Path

    from .checkpoint import (
        check_resumed_config,
        checkpoint_dir,
        checkpoint_step,
        find_checkpoint,
        load_checkpoint,
    )
    from .logs import read_metrics

    found = find_checkpoint(cfg.resume, cfg.output_dir)
    done = None if found is None else checkpoint_step(found)
    if done is None or done < cfg.steps:
        return False
    check_resumed_config(load_checkpoint(found, mmap=True), cfg, found, lambda line: None)
    print(f"the run is complete: checkpoint {found} is at step {done}, --steps is {cfg.steps}; "
          "nothing to do (a larger --steps trains further)", flush=True)
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    if metrics.is_file() and found.resolve().parent == checkpoint_dir(cfg.output_dir).resolve():
        history = {r["step"]: r["eval_accuracy"] for r in read_metrics(metrics)
                   if "eval_accuracy" in r and r["step"] <= done}
        if history:
            _print_held_out(history)
    return True


if __name__ == "__main__":
    sys.exit(main())
