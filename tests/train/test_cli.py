"""The command lines as a user meets them, each run as a subprocess: `python -m grpo_train`,
`python -m benchmarks`, `python -m benchmarks.trainer_step` and the examples' output.

A user error is one line `PROG: error: ...` on stderr naming the flag, exit status 2, no
traceback (--debug shows it); flags are never matched by prefix and take both spellings; a hub id
without network fails in seconds; an output directory holding a run is never overwritten
silently; --help documents every flag. Error cases fail before any model is loaded, so each
subprocess takes a few seconds (mostly importing torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A run of a second or two: tiny model, few prompts, short completions (as tests/test_train_loop)
TINY_RUN = ["--steps", "1", "--num_prompts", "2", "--num_generations", "2", "--max_new_tokens",
            "2", "--format_warmup_steps", "1", "--tiny_hidden_size", "16", "--task_terms", "2",
            "--task_max_operand", "3", "--eval_every", "0", "--backend", "chunked",
            "--no_progress", "--no_plot", "--no_save_final_model", "--num_threads", "1"]


def run(args: list[str], cwd: Path | None = None, env: dict | None = None, timeout: float = 300,
        module: str = "grpo_train") -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, prog: str = "grpo-train") -> str:
    """The single stderr line of a user error (asserts the shape: status 2, no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


# ---- grpo-train: user errors ----------------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    (["--learning-rat", "1e-3"], "unrecognized arguments: --learning_rat"),  # no prefix match
    (["--num_generations", "1"], "--num_generations must be >= 2"),
    (["--num-generations", "1"], "--num_generations must be >= 2"),  # the hyphenated alias
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--loss_type", "ppo"], "argument --loss_type: invalid choice: 'ppo'"),
    (["--bf16", "maybe"], "--bf16: expected true or false"),
    (["--epsilon_low", "-1"], "--epsilon_low and --epsilon_high must be >= 0"),
    (["--epsilon", "0.1"], "--epsilon is TRL's GRPOConfig name of --epsilon_low"),
    (["--temperature", "0"], "--temperature must be >= 0.0001, got 0"),
    (["--temperature", "1e-45"], "--temperature must be >= 0.0001, got 1e-45"),
    (["--grad_filter", "fast"], "--grad_filter must be"),
    (["--config", "no_such_config.yaml"], "--config 'no_such_config.yaml': no such file"),
    (["--resume", "auto", "--overwrite"], "--resume and --overwrite contradict"),
])
def test_argument_errors_are_one_line(args, named, tmp_path):
    line = one_line_error(run([*args, "--output_dir", str(tmp_path / "run")]))
    assert named in line


def test_input_errors_are_one_line_before_any_model_loads(tmp_path):
    """Bad --model / --reward / --dataset values, each in a fresh process; and --debug turns
    an error back into a traceback. (More bad inputs, in-process:
    tests/train/test_train_loop.py.)"""
    no_columns = tmp_path / "d.jsonl"
    no_columns.write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    cases = [
        (["--model", "/no/such/model_dir"], "--model '/no/such/model_dir': no such directory"),
        (["--dataset", "/no/such/file.jsonl"], "--dataset '/no/such/file.jsonl': no such file"),
        (["--resume", "/no/such/step_000001.pt"], "--resume '/no/such/step_000001.pt': no such"),
        (["--reward", "no_such_pkg.rewards:fn"], "--reward 'no_such_pkg.rewards:fn': cannot "
         "import 'fn' from 'no_such_pkg.rewards' (ModuleNotFoundError"),
        (["--dataset", str(no_columns)], "has no column --prompt_column 'question', "
         "--answer_column 'answer'; its columns are ['problem', 'solution']"),
    ]
    for i, (args, named) in enumerate(cases):
        proc = run([*args, "--output_dir", str(tmp_path / f"run{i}"), *TINY_RUN[:2]])
        assert named in one_line_error(proc), args
        assert not (tmp_path / f"run{i}" / "initial_model").exists()  # failed before building

    debug = run(["--num_generations", "1", "--debug"])
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert "UsageError: --num_generations must be >= 2" in debug.stderr


def test_hub_id_without_network_fails_fast(tmp_path):
    """No network (an endpoint nothing listens on) and HF_HUB_OFFLINE=1 with an empty cache:
    a few seconds each, one line saying why and what to pass instead; no retry loop."""
    hub_id = "Qwen/Qwen2.5-0.5B-Instruct"
    cache = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_CACHE": str(tmp_path / "hf_home"),
             "HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", "HTTPS_PROXY": "",
             "https_proxy": "", "ALL_PROXY": "", "all_proxy": ""}
    start = time.perf_counter()
    proc = run(["--model", hub_id, "--output_dir", str(tmp_path / "r1")],
               env={**cache, "HF_ENDPOINT": "http://127.0.0.1:9"})  # port 9: refused at once
    line = one_line_error(proc)
    assert f"--model '{hub_id}' is not a local path" in line and "cannot be reached" in line
    assert "local model directory" in line and "HF_HUB_OFFLINE=1" in line
    proc = run(["--model", hub_id, "--output_dir", str(tmp_path / "r2")],
               env={**cache, "HF_HUB_OFFLINE": "1"})
    line = one_line_error(proc)
    assert "HF_HUB_OFFLINE=1 forbids downloading it; pass a local model directory" in line
    proc = run(["--dataset", "openai/gsm8k", "--output_dir", str(tmp_path / "r3")],
               env={**cache, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert "--dataset 'openai/gsm8k' is not a local path" in one_line_error(proc)
    # three processes: interpreter + torch import each, never the 8 s hub retries
    assert time.perf_counter() - start < 120


# ---- grpo-train: the output directory ----------------------------------------------------------


def test_output_dir_is_never_overwritten_silently(tmp_path):
    out = tmp_path / "run"
    first = run([*TINY_RUN, "--output_dir", str(out), "--save_every", "1", "--steps", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001.pt",
                                                                       "step_000002.pt"]
    metrics_before = (out / "metrics.jsonl").read_text()

    again = run([*TINY_RUN, "--output_dir", str(out)])
    line = one_line_error(again)
    assert f"--output_dir '{out}' already holds files" in line
    assert "--resume auto" in line and "--overwrite" in line
    assert (out / "metrics.jsonl").read_text() == metrics_before  # untouched

    (out / "notes.txt").write_text("mine")  # not a run file: --overwrite leaves it alone
    fresh = run([*TINY_RUN, "--output_dir", str(out), "--overwrite", "--save_every", "1"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "--overwrite: deleted the previous run's" in fresh.stdout
    # only this run's checkpoint: the old step_000002.pt is gone, not mixed in
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001.pt"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
    assert (out / "notes.txt").read_text() == "mine"

    resumed = run([*TINY_RUN, "--output_dir", str(out), "--resume", "auto", "--steps", "2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    no_ckpt = tmp_path / "no_ckpt"
    assert run([*TINY_RUN, "--output_dir", str(no_ckpt), "--save_every", "0"]).returncode == 0
    line = one_line_error(run([*TINY_RUN, "--output_dir", str(no_ckpt), "--resume", "auto"]))
    assert "holds a previous run's files but no checkpoint" in line


def test_resume_of_a_complete_run_changes_nothing(tmp_path):
    """--resume auto after the last step: one line saying the run is complete (and its held-out
    accuracy), exit 0; no model is loaded and no file in OUTPUT_DIR is rewritten."""
    out = tmp_path / "run"
    args = [*TINY_RUN, "--output_dir", str(out), "--save_every", "1", "--steps", "2",
            "--eval_every", "1"]
    first = run(args)
    assert first.returncode == 0, first.stderr[-3000:]

    def snapshot():
        return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}

    before = snapshot()
    assert "checkpoints/step_000002.pt" in before and "metrics.jsonl" in before
    time.sleep(0.05)  # a rewrite would show in the nanosecond mtimes
    again = run([*args, "--resume", "auto"])
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stdout.strip().splitlines()
    assert lines[0].startswith("the run is complete: checkpoint ") and "at step 2" in lines[0]
    assert lines[1].startswith("held-out accuracy: step 0 ") and len(lines) == 2, lines
    assert "resumed from" not in again.stdout and "format warm-up" not in again.stdout
    assert snapshot() == before
    # a setting that changes what the run trains is refused there as on a run that trains on
    changed = run([*args, "--resume", "auto", "--learning_rate", "0.5"])
    line = one_line_error(changed)
    assert "--learning_rate 0.5 (the checkpoint's: " in line, line
    assert snapshot() == before
    # a larger --steps continues the same run
    more = run([*TINY_RUN, "--output_dir", str(out), "--save_every", "1", "--steps", "3",
                "--resume", "auto"])
    assert more.returncode == 0 and "resumed from" in more.stdout, more.stderr[-3000:]
    assert (out / "checkpoints" / "step_000003.pt").exists()


# ---- grpo-train: --help and --version ------------------------------------------------------------


def test_version_prints_the_package_version():
    import grpo_kernels

    proc = run(["--version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"grpo-train {grpo_kernels.__version__}\n"
    assert "--version" in run(["--help"]).stdout


def test_help_documents_every_flag_by_topic():
    proc = run(["--help"])
    assert proc.returncode == 0
    text = proc.stdout
    for topic in ("model:", "data:", "rewards:", "generation:", "loss:", "optimization:",
                  "logging and evaluation:", "checkpoints and output:", "distributed:"):
        assert f"\n{topic}" in text, topic
    # descriptions come from config.py's field metadata; auto fields show both values
    assert "G: completions per prompt (a group); must be >= 2 (default: 8)" in text
    assert "(default: 64 for the embedded run, 16 with --model)" in " ".join(text.split())
    assert "--bf16/--no_bf16" in text and "--progress/--no_progress" in text
    assert "(default: None)" not in text and "[BF16]" not in text
    # defaults as they behave; documentation cited by file, not by README section
    flat = " ".join(text.split())
    assert "--eval_size N|auto" in text and "(default: auto)" in flat
    assert "(default: 1 for the embedded run, 0 with --model)" in flat  # --num_threads
    assert "docs/semantics.md" in flat and "docs/internals.md" in flat and "README" not in flat
    from grpo_train.config import TrainConfig

    for name in TrainConfig.__dataclass_fields__:
        assert f"--{name}" in text, name
    assert max(len(line) for line in text.splitlines()) <= 100


def test_boolean_and_hyphen_spellings_parse_alike():
    from grpo_train.cli import parse_config

    a = parse_config(["--no-bf16", "--gradient-checkpointing", "--num-generations", "4"])
    b = parse_config(["--no_bf16", "--gradient_checkpointing", "true", "--num_generations=4"])
    assert a == b and a.gradient_checkpointing and not a.bf16 and a.num_generations == 4


# ---- benchmarks ---------------------------------------------------------------------------------


def test_benchmark_clis_share_the_conventions(tmp_path):
    line = one_line_error(run(["--quic"], module="benchmarks"), "python -m benchmarks")
    assert "unrecognized arguments: --quic" in line
    line = one_line_error(run(["--heads", "nope", "--no_ceilings"], module="benchmarks"),
                          "python -m benchmarks")
    assert "--heads: unknown head(s) ['nope']" in line
    line = one_line_error(run(["--from_csv", str(tmp_path / "none.csv")], module="benchmarks"),
                          "python -m benchmarks")
    assert "--from_csv" in line and "no such file" in line
    prog = "python -m benchmarks.trainer_step"
    line = one_line_error(run(["--provider", "fused", "--tin"],
                              module="benchmarks.trainer_step"), prog)
    assert "unrecognized arguments: --tin" in line  # not taken as --tiny
    line = one_line_error(run(["--provider", "fused", "--prompt-tokens", "1"],
                              module="benchmarks.trainer_step"), prog)
    assert "--prompt_tokens must be >= 2" in line
    # both spellings of a flag, on the committed results (nothing is measured)
    committed = ROOT / "benchmarks" / "results" / "cpu-amd-epyc-2-cores.csv"
    for flag in ("--from_csv", "--from-csv"):
        proc = run([flag, str(committed), "--modes", "fwd+bwd", "--markdown"],
                   module="benchmarks")
        assert proc.returncode == 0 and "| fused_linear | ours |" in proc.stdout, proc.stderr


def test_benchmark_results_go_to_a_results_directory(tmp_path):
    """No --out: the CSVs land in results/ under the working directory (created), never in the
    working directory itself (the repository root, when run from there) nor in the package's
    results/."""
    before = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    sweep = run(["--heads", "tiny", "--tokens", "64", "--kernels", "fused_linear",
                 "--providers", "reference", "--modes", "forward", "--no_ceilings",
                 "--cpu_budget", "0", "--device", "cpu", "--threads", "1"],
                cwd=tmp_path, module="benchmarks")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    out = tmp_path / "results"
    csvs = [p.name for p in out.glob("*.csv")]
    assert len(csvs) == 1 and csvs[0].startswith("cpu-"), csvs
    step = run(["--provider", "fused", "--tiny", "--steps", "1", "--backend", "chunked",
                "--device", "cpu"], cwd=tmp_path, module="benchmarks.trainer_step")
    assert step.returncode == 0, step.stderr[-3000:]
    assert [p.name for p in out.glob("*-trainer.csv")] == [csvs[0][:-4] + "-trainer.csv"]
    assert [p.name for p in tmp_path.iterdir()] == ["results"]
    assert sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir()) == before


# ---- examples -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("script, lines", [
    ("hf_plain_pytorch.py", r"(step \d+: loss .*|done: \d+ steps in .*s)"),
    ("trl_swap.py",
     r"(step \d+: loss .*|grpo-kernels trainer \(shared rows\): .*|done: \d+ steps)"),
])
def test_examples_print_only_their_own_lines(script, lines):
    import re

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the examples' CPU path is the chunked PyTorch one
    # DeepSpeed (a test dependency, for the ZeRO-3 tests) warns on stdout that it found no GPU
    # whenever accelerate or TRL probes it; naming its accelerator is what a CPU user does to
    # quiet it, and the lines left are the example's own
    env.setdefault("DS_ACCELERATOR", "cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip() == "", proc.stderr[-3000:]  # no bars, logging or warnings
    out = proc.stdout.strip().splitlines()
    assert out and all(re.fullmatch(lines, line) for line in out), out
