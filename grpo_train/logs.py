"""What a user sees and keeps: the step's metrics record (reduced over processes), one log line per
step, a progress bar, metrics.jsonl, and curves.png at the end."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from .flags import UsageError


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max_memory_allocated since the last reset (this step). CPU: the process' peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_line(m: dict) -> str:
    """The one line per step, in a fixed order, with the numbers that matter."""
    parts = [
        f"step {m['step']}",
        f"reward {_fmt(m.get('reward'), '.3f')}±{_fmt(m.get('reward_std'), '.3f')}",
    ]
    if "accuracy" in m:
        parts.append(f"acc {_fmt(m['accuracy'], '.3f')}")
    if "eval_accuracy" in m:
        parts.append(f"eval_acc {_fmt(m['eval_accuracy'], '.3f')}")
    if "kl" in m:
        parts.append(f"kl {_fmt(m['kl'], '.4f')}")
    if "clip_ratio/region_mean" in m:
        parts.append(f"clip {_fmt(m['clip_ratio/low_mean'], '.3f')}/"
                     f"{_fmt(m['clip_ratio/high_mean'], '.3f')}")
    parts += [
        f"ent {_fmt(m.get('entropy'), '.3f')}",
        f"len {_fmt(m.get('completion_length'), '.1f')}",
        f"loss {_fmt(m.get('loss'), '.4f')}",
        f"gnorm {_fmt(m.get('grad_norm'), '.3f')}",
        f"{_fmt(m.get('tokens_per_s'), ',.0f')} tok/s",
        f"mem {_fmt(m.get('peak_memory_gib'), '.2f')}GiB",
    ]
    if m.get("unscored"):
        parts.append(f"unscored {m['unscored']}")
    if m.get("kernel_fallbacks"):  # only then: the usual line stays as it was
        parts.append(f"kernel_fallbacks {m['kernel_fallbacks']}")
    return " | ".join(parts)


class MetricsLog:
    """Appends one JSON object per step to OUTPUT_DIR/metrics.jsonl (main process only).

    On resume, records after the checkpoint's step are dropped, so the file reads as one run.
    """

    def __init__(self, output_dir, enabled: bool, resume_step: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl. A last line that does not parse and has no newline after
    it is a record torn by a crash in mid-write (kill -9, a full disk): it is dropped, as its
    step is past the last checkpoint. Any other line that does not parse is a UsageError."""
    with open(path) as fh:
        lines = fh.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # the last line, no newline after it: torn
                break
            raise UsageError(f"{path}: line {number} is not a JSON record ({err}); fix or "
                             "delete that line") from err
    return records


def plot_curves(output_dir) -> str:
    """curves.png of reward, accuracy (train and held-out) and completion length; returns a
    message for the log (the path, or how to get matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("curves.png not written: matplotlib is not installed "
                "(pip install 'grpo-kernels[plot]'); the numbers are in metrics.jsonl")
    records = read_metrics(Path(output_dir) / "metrics.jsonl")
    train = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    series = [("reward", "reward (mean)"), ("accuracy", "accuracy"),
              ("completion_length", "completion length (tokens)")]
    for ax, (key, title) in zip(axes, series):
        pts = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label="train (sampled)", lw=1)
        if key == "accuracy" and evals:
            ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-",
                    label="held-out (greedy)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "accuracy":
            ax.legend()
    fig.tight_layout()
    out = Path(output_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return f"curves written to {out}"


def kernel_fallbacks() -> int:
    """Kernel calls of this process so far that ran on the chunked PyTorch path because their
    Triton kernel failed to compile or launch (`grpo_kernels.fallback_counts`, all variants)."""
    from grpo_kernels import fallback_counts

    return sum(fallback_counts().values())


class StepStart(NamedTuple):
    """Where a step's measurements start (`step_start`)."""

    time: float  # time.perf_counter()
    kernel_fallbacks: int  # `kernel_fallbacks()`


def step_start() -> StepStart:
    return StepStart(time.perf_counter(), kernel_fallbacks())


def step_metrics(run, step, batch, all_rewards, rewards, sums, loss_total, grad_norms,
                 start: StepStart) -> dict:
    """One record: rewards over all processes; loss metrics token-weighted over all processes.
    run: the `RunState` (accel, cfg, device, acc_col, scheduler); all_rewards: [P·G, F] of all
    processes, rewards: [P·G] their weighted sums (NaN = unscored); sums: metric sums weighted
    by loss tokens, with their "_tokens"; start: the step's `step_start()`. "kernel_fallbacks"
    (the step's kernel calls on the fallback, all processes) is in the record only when > 0."""
    accel, cfg, device = run.accel, run.cfg, run.device
    keys = sorted(k for k in sums if k != "_tokens")
    local = [sums[k] for k in keys] + [sums["_tokens"], batch["lengths"].float().sum().item(),
                                       batch["truncated"].float().sum().item(),
                                       batch["prompt_tokens"].item(), loss_total,
                                       kernel_fallbacks() - start.kernel_fallbacks]
    total = accel.reduce(torch.tensor(local, dtype=torch.float64, device=device), "sum")
    total = (total / run.tp).tolist()  # a tensor-parallel group's ranks hold the same batch
    n_seq = float(cfg.num_prompts * cfg.num_generations)
    n_tok = max(total[len(keys)], 1.0)
    comp_tokens, truncated, prompt_tokens, loss_sum, fallbacks = total[len(keys) + 1:]
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the step's kernels are part of its time
    elapsed = time.perf_counter() - start.time
    peak = accel.reduce(torch.tensor(float(peak_memory_bytes(device)), device=device), "max")
    scored = rewards[~torch.isnan(rewards)]
    record = {
        "step": step,
        "reward": scored.mean().item() if scored.numel() else math.nan,
        "reward_std": scored.std().item() if scored.numel() > 1 else math.nan,
    }
    if run.acc_col is not None:
        record["accuracy"] = torch.nanmean(all_rewards[:, run.acc_col]).item()
    record.update({k: v / n_tok for k, v in zip(keys, total)})
    record.update({
        "completion_length": comp_tokens / n_seq,
        "truncated_ratio": truncated / n_seq,
        "loss": loss_sum / run.world,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "lr": run.scheduler.get_last_lr()[0],
        "tokens_per_s": (comp_tokens + prompt_tokens) / elapsed,
        "step_time_s": elapsed,
        "peak_memory_gib": peak.item() / 2**30,
        "unscored": int(torch.isnan(rewards).sum().item()),
    })
    if fallbacks:
        record["kernel_fallbacks"] = int(fallbacks)
    return record


def printer(enabled: bool):
    """say(msg): one line on the main process, above the progress bar when there is one."""

    def say(msg: str) -> None:
        if enabled:
            try:
                from tqdm import tqdm

                tqdm.write(msg)
            except ImportError:
                print(msg, flush=True)

    return say


class RouteLines(logging.Handler):
    """The "grpo_kernels" logger's own lines during a run: the route each loss and log-prob call
    takes, and why (`grpo_kernels.ops.route`, one line per route and reason in a process). Held
    until `start(say)` gives the run's line printer (the format warm-up runs before it), then
    said as run lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.say, self.held = None, []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "grpo_kernels":  # not its children's (the run says those itself)
            self.held.append(record.getMessage())
            self.start(self.say)

    def start(self, say) -> None:
        self.say = say
        while say is not None and self.held:
            say(self.held.pop(0))


@contextlib.contextmanager
def route_lines():
    """A `RouteLines` on the "grpo_kernels" logger for the block, its level lowered to INFO if
    it was unset and above it; the logger as it was afterwards."""
    logger = logging.getLogger("grpo_kernels")
    handler, level = RouteLines(), logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def progress_bar(cfg, enabled: bool, start: int):
    """A tqdm bar over the steps (None: disabled, not the main process, or no tqdm)."""
    if not (enabled and cfg.progress):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=cfg.steps, initial=start, desc="grpo", unit="step", dynamic_ncols=True)


def show(bar, say, line: str) -> None:
    """A step's log line, then the bar one step on."""
    say(line)
    if bar is not None:
        bar.update(1)
