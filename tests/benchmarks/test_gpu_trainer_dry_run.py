"""benchmarks/gpu_trainer.sh, the prepared device script: its dry run (DRY_RUN=1: every step on the
CPU at tiny shapes, in a few minutes) exits 0 and writes every step's rows: the sdpa probe's (cold
and warm per backend, the profiled default's backend); generation with bf16 weights and under
autocast, naming the path that ran, and last the padded run without cuDNN attention; the loss
runs warmed on each timed step's lengths, taking each attention implementation the rule considers
on the CPU and reporting the layout and attention that ran; whole steps, grpo_train's on the
static path; and the step runner's rows (ok, n/a for a missing package, timeout, failure, skipped
at the deadline), which the dry run cannot reach."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def read(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_dry_run_writes_every_steps_rows(tmp_path):
    """~2-3 minutes on a 2-core CPU (fifteen short processes)."""
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    run = subprocess.run(["bash", "benchmarks/gpu_trainer.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = {r["step"]: r for r in read(tmp_path / "gpu_trainer.csv")}
    trl = summary["step-p16-trl"]["status"] != "n/a: trl, datasets not installed"
    assert list(summary) == [
        "sdpa-probe", "generation-p16-padded-no-cudnn", "generation-p16-bf16",
        "generation-p16-autocast", "loss-p16-padded", "loss-p16-packed-sdpa",
        "loss-p16-packed-eager", "loss-p48-padded", "loss-p48-shared-sdpa",
        "loss-p48-shared-eager", "loss-p16-trl", "loss-p16-trl-kernels", "step-p16-trl",
        "step-p16-trl-kernels", "step-p16-fused-static-eager"], run.stdout[-3000:]
    for name, r in summary.items():
        missing = "-trl" in name and not trl
        assert r["status"] == ("n/a: trl, datasets not installed" if missing else "ok"), (
            name, r, (tmp_path / "gpu_trainer.log").read_text()[-3000:])
    for name in ("env.txt", "steps.txt", "gpu_trainer.log"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert not (tmp_path / "assets").exists()  # the model's weights never travel back
    results = tmp_path / "results"
    steps = read(next(results.glob("*-trainer.csv")))
    ran = [(r["provider"], r["prompt_tokens"], r["attn_implementation"], r["row_layout"],
            r["attention"]) for r in steps]
    fused = "grpo_train+fused"
    assert ran[:6] == [(fused, "16", "auto", "padded", "sdpa"),
                       (fused, "16", "sdpa", "packed", "sdpa"),
                       (fused, "16", "eager", "packed", "eager"),
                       (fused, "48", "auto", "padded", "sdpa"),
                       (fused, "48", "sdpa", "shared", "sdpa"),
                       (fused, "48", "eager", "shared", "eager")]
    assert all(r["status"] == "ok" and float(r["loss_s"]) > 0 for r in steps)
    synthetic = 8 if trl else 6
    assert all(r["generation"] == "synthetic" and r["warmup"] == r["timed_steps"]
               for r in steps[:synthetic])  # a warm-up step per timed step
    whole = [(r["provider"], r["row_layout"], r["generation_path"]) for r in steps[synthetic:]]
    assert whole[-1] == (fused, "shared", "static")  # real generation, the static path
    if trl:
        assert [r["provider"] for r in steps[6:8]] == ["trl GRPOTrainer",
                                                       "grpo_kernels.trl GRPOTrainer"]
        assert [w[0] for w in whole] == ["trl GRPOTrainer", "grpo_kernels.trl GRPOTrainer", fused]
        assert whole[0][1] == "padded" and whole[1][1] == "shared"
    gen = read(next(results.glob("*-generation.csv")))
    assert [(r["path"], r["dtype"], r["autocast"], r["ran_path"]) for r in gen] == [
        ("padded", "bfloat16", "False", "padded"),
        ("per-row", "bfloat16", "False", "padded"), ("padded", "bfloat16", "False", "padded"),
        ("static-eager", "bfloat16", "False", "static"),
        ("continuous", "bfloat16", "False", "continuous"),
        ("padded", "float32", "True", "padded"), ("static-eager", "float32", "True", "static")]
    assert [r["sdpa_backends"] for r in gen] == ["flash,efficient,math"] + ["default"] * 6
    assert len({r["completion_tokens"] for r in gen}) == 1  # the same forced lengths
    assert {r["prompt_tokens"] for r in gen} == {"16"}
    probe = read(next(results.glob("*-sdpa.csv")))
    backends = ("default", "cudnn", "flash", "efficient", "math")
    assert [(r["call"], r["backend"]) for r in probe] == [
        (c, b) for c in ("gqa", "masked") for b in backends] + [("gqa", "default"),
                                                                ("masked", "default")]
    assert [r["status"].split(":")[0] for r in probe] == (
        ["ok", "no available kernel", "ok", "no available kernel", "ok"] * 2 + ["profiled"] * 2)
    assert all(float(r["cold_ms_median"]) > 0 for r in probe if r["status"] == "ok")
    assert [r["ran"] for r in probe[10:]] == ["flash", "flash"]  # the CPU's bf16 choice

STEPS = """
set -u
cd "$ROOT"
stamp() { echo "[stamp] $*"; }
START=$(date +%s); MIN_STEP_S=3  # DEADLINE: from the environment
SUMMARY="$OUT/s.csv"; LOG="$OUT/s.log"
echo "step,status,seconds,command" > "$SUMMARY"
source benchmarks/gpu_steps.sh
run_step fine 10 - true
run_step missing 10 "no_such_module_for_this_test" true
run_step broken 10 - bash -c "exit 3"
run_step slow 1 - sleep 5
run_step "with, comma" 10 "os, sys" echo "a, b"
"""


@pytest.mark.parametrize("deadline", [60, 2])
def test_step_runner_rows(tmp_path, deadline):
    env = dict(os.environ, ROOT=str(ROOT), OUT=str(tmp_path), DEADLINE=str(deadline))
    run = subprocess.run(["bash", "-c", STEPS], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    rows = {r["step"]: r["status"] for r in read(tmp_path / "s.csv")}
    if deadline == 2:  # under MIN_STEP_S left: nothing starts; a missing package still says so
        assert rows.pop("missing") == "n/a: no_such_module_for_this_test not installed"
        assert list(rows) == ["fine", "broken", "slow", "with, comma"]
        assert all(v.startswith("skipped: ") and v.endswith("s left of the 2s deadline")
                   for v in rows.values()), rows
        return
    assert rows == {"fine": "ok", "missing": "n/a: no_such_module_for_this_test not installed",
                    "broken": "failed: exit 3", "slow": "timeout after 1s", "with, comma": "ok"}
    assert "a, b" in (tmp_path / "s.log").read_text()


def _tree(tmp_path: Path, drop: str = "") -> Path:
    """A copy of the device script and what it sources (`drop` cut from gpu_trainer.sh), with a
    .whl/ and an install_wheels.sh that only says how `timeout` called it."""
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / ".whl").mkdir()
    (tree / ".whl" / "x.whl").write_text("")
    for name in ("gpu_common.sh", "gpu_steps.sh", "gpu_trainer.sh"):
        text = (ROOT / "benchmarks" / name).read_text()
        if name == "gpu_trainer.sh" and drop:
            assert drop in text
            text = text.replace(drop, "", 1)
        (tree / "benchmarks" / name).write_text(text)
    (tree / "benchmarks" / "install_wheels.sh").write_text(
        "echo \"called as: $(tr '\\0' ' ' < /proc/$PPID/cmdline)\"\n")
    return tree


def _run(tree: Path, out: Path, **env) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OUT=str(out), PYTHONPATH=path, **env)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", "benchmarks/gpu_trainer.sh"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_peers_install_is_cut_to_the_deadline(tmp_path):
    """A device run's deadline (DEADLINE_S) bounds the peers' install as it bounds each step:
    here 25 s, under the install's own 60 s and under every step's minimum (all skipped)."""
    run = _run(_tree(tmp_path), tmp_path / "out", DRY_RUN="0", PARTS="steps", DEADLINE_S="25")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    env = (tmp_path / "out" / "env.txt").read_text()
    (called,) = [line.split()[3] for line in env.splitlines() if line.startswith("called as:")]
    assert 0 < int(called) <= 25, env[-500:]  # timeout N bash benchmarks/install_wheels.sh
    assert "deadline 25s" in (tmp_path / "out" / "steps.txt").read_text()
    rows = read(tmp_path / "out" / "gpu_trainer.csv")
    assert rows and all(r["status"].startswith(("skipped: ", "n/a: ")) for r in rows), rows


def test_the_dry_run_sets_what_the_device_run_sets(tmp_path):
    """The dry run's settings are checked against the device run's before anything runs: one
    that only the device run sets stops the script (exit 2) and is named."""
    tree = _tree(tmp_path, drop=" NO_CUDNN_BUDGET_S=90")
    run = _run(tree, tmp_path / "out", DRY_RUN="1", PARTS="none")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "must set the same variables" in run.stderr and "NO_CUDNN_BUDGET_S" in run.stderr
