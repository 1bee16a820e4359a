"""Benchmark harness for grpo-kernels: providers × modes × shapes -> table, CSV and plot.

`python -m benchmarks --help` runs a sweep; `pytest benchmarks/ --benchmark-only` runs the
pytest-benchmark suite. This module holds what every part shares: the lm heads and token counts
that make a shape, the work accounting (FLOPs and bytes) that turns milliseconds into rates, and
the environment description written next to every number (device, versions, commit).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Real lm heads (hidden size D, vocabulary V) from the models' configs, plus two synthetic ones
# that keep CPU runs short. The synthetic ones are labelled as such everywhere they appear.
HEADS: dict[str, tuple[int, int]] = {
    "qwen0.5b": (896, 151936),  # Qwen2.5-0.5B
    "qwen7b": (3584, 152064),  # Qwen2.5-7B
    "llama8b": (4096, 128256),  # Llama-3-8B
    "llama1b": (2048, 128256),  # Llama-3.2-1B
    "small": (512, 32768),  # synthetic (CPU runs)
    "tiny": (128, 4096),  # synthetic (CPU runs, tests)
}
KERNELS = ("fused_linear", "logits")
# "score": the forward without a gradient (torch.no_grad: scoring old or reference log-probs);
# "forward": the forward of a step that a backward follows (the inputs require grad)
MODES = ("score", "forward", "backward", "fwd+bwd")
STEP_MODES = ("forward", "backward", "fwd+bwd")  # the default sweeps' modes
MAX_SEQ_LEN = 1024  # completions are split into sequences of at most this many positions


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: N = B·T completion tokens on an lm head [V, D]."""

    head: str
    N: int
    D: int
    V: int
    B: int
    T: int

    @property
    def label(self) -> str:
        return f"{self.head} N={self.N}"

    @property
    def detail(self) -> str:
        return f"B={self.B} T={self.T} D={self.D} V={self.V}"


def make_shape(head: str, n_tokens: int, dims: tuple[int, int] | None = None) -> Shape:
    """Split N tokens into B sequences of T positions (T <= MAX_SEQ_LEN, at least 8 sequences
    when N allows, so that per-sequence advantages and padding vary)."""
    D, V = dims if dims is not None else HEADS[head]
    T = min(MAX_SEQ_LEN, max(1, n_tokens // 8))
    if n_tokens % T:
        raise ValueError(f"N={n_tokens} is not a multiple of the sequence length {T}")
    return Shape(head, n_tokens, D, V, n_tokens // T, T)


# ---- work accounting ------------------------------------------------------------------------
# Fused linear loss (hidden [N, D] @ weight[V, D]^T, never stored): the forward is one N·V·D
# product (2·N·V·D FLOPs); the backward forms d hidden and d weight, two more (4·N·V·D): 6·N·V·D
# for fwd+bwd, the work the loss needs, whichever route does it. A route's own extra products
# (the four-pass backward recomputes the logits: 8·N·V·D done) are its cost, not counted as work,
# so that a rate never passes the matmul ceiling. N counts the positions the loss reads (the
# unmasked ones): a provider that also computes the padding's rows does more than the work.
# Logits path (logits [N, V] given): forward reads the logits once, backward reads them again and
# writes their gradient; three passes over P·V elements in all, P the unmasked positions as for
# the head (the same mask for every provider): a provider that also reads the padding's rows
# does more than the work.
HEAD_FLOPS = {"score": 2.0, "forward": 2.0, "backward": 4.0, "fwd+bwd": 6.0}  # × rows·V·D


def head_flops(rows: int, V: int, D: int, mode: str) -> float:
    """The FLOPs of `mode` of a linear-head loss on `rows` positions of a [V, D] head."""
    return HEAD_FLOPS[mode] * float(rows) * V * D


def flops(shape: Shape, mode: str, rows: int | None = None) -> float:
    """`head_flops` at the shape's head; rows: the positions counted (default: all N)."""
    return head_flops(shape.N if rows is None else rows, shape.V, shape.D, mode)


LOGITS_PASSES = {"score": 1, "forward": 1, "backward": 2, "fwd+bwd": 3}  # × rows·V elements


def logits_bytes(shape: Shape, mode: str, elem_size: int, rows: int | None = None) -> float:
    """The bytes `mode` of the logits-path loss moves over the logits [rows, V] (elements of
    `elem_size` bytes); rows: the positions counted (default: all N)."""
    rows = shape.N if rows is None else rows
    return float(LOGITS_PASSES[mode]) * rows * shape.V * elem_size


# ---- environment ----------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_label(device: torch.device) -> str:
    """Human-readable device name written into every row (never ambiguous about CPU vs GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"CPU {cpu_model()} ({os.cpu_count()} cores, {threads} thread{'s' * (threads != 1)})"


def device_slug(device: torch.device) -> str:
    """File-name form of the device: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3',
    'AMD EPYC' with 2 cores -> 'cpu-amd-epyc-2-cores' (thread count not in the name)."""
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"cpu {cpu_model()} {os.cpu_count()} cores")
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def git_commit() -> str:
    """Short commit of the checkout (+'-dirty' with uncommitted changes); BENCH_COMMIT overrides,
    for copies of the tree without .git (the device machine)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        sha = run("rev-parse", "--short", "HEAD")
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> dict[str, str]:
    return {
        "device": device_label(device),
        "torch": torch.__version__,
        "triton": triton_version(),
        "commit": git_commit(),
    }


def show_routes() -> None:
    """Prints the "grpo_kernels" logger's INFO lines on stderr, as "# ..." lines: the first call
    of each route of the linear-head loss says which route it took and why (three-pass, or
    four-pass and the reason), so a sweep's log shows what each `ours` variant ran."""
    import logging
    import sys

    log = logging.getLogger("grpo_kernels")
    if not any(getattr(h, "_bench_routes", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("# %(message)s"))
        handler._bench_routes = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)
