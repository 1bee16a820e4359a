"""`grpo_train --tp_size` (transformers' tensor parallelism under torchrun, two CPU processes,
gloo) and the tensor-parallel example: a short run trains, writes full-tensor checkpoints and a
plain final model, and resumes; the flags it refuses say so before anything loads."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_train.cli import parse_config
from grpo_train.flags import UsageError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "parallel"))
from mp_launch import free_port  # noqa: E402


@pytest.mark.parametrize("flags, message", [
    (["--tp_size", "0"], "--tp_size must be a whole number >= 1"),
    (["--tp_size", "2", "--fsdp"], "--tp_size 2 with --fsdp is not supported"),
    (["--tp_size", "2", "--lora_r", "4"], "--tp_size 2 with --lora_r is not supported"),
    (["--tp_size", "2", "--fp32_lm_head"], "--tp_size 2 with --fp32_lm_head is not supported"),
])
def test_refused_combinations_fail_before_loading(flags, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_config(flags)


def test_tp_size_needs_as_many_processes():
    from grpo_train import tensor_parallel

    with pytest.raises(UsageError, match=r"--tp_size 2 needs 2 processes.*torchrun "
                                         r"--nproc_per_node 2 -m grpo_train --tp_size 2"):
        tensor_parallel.require(2, 1)


def test_gathered_rows_count_each_group_once():
    from grpo_train.tensor_parallel import data_rows

    rows = torch.arange(8.0).view(8, 1)  # 4 processes x 2 rows: groups {0, 1} and {2, 3}
    assert data_rows(rows, 2, 4).view(-1).tolist() == [0.0, 1.0, 4.0, 5.0]
    assert data_rows(rows, 1, 4) is rows


def _torchrun(args, out_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True,
                          timeout=600)


SMALL = ["--tiny_hidden_size", "32", "--num_prompts", "4", "--num_generations", "4",
         "--format_warmup_steps", "2", "--task_terms", "2", "--task_max_operand", "5",
         "--eval_every", "2", "--save_every", "2", "--no-plot", "--no-progress",
         "--device", "cpu"]


@pytest.mark.slow
def test_two_ranks_train_save_and_resume(tmp_path):
    out = tmp_path / "run"
    first = _torchrun(["-m", "grpo_train", "--tp_size", "2", "--steps", "2", "--output_dir",
                       str(out), *SMALL], tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    log = first.stdout + first.stderr
    assert "generation: padded" in log
    assert "held-out accuracy: step 0" in log
    second = _torchrun(["-m", "grpo_train", "--tp_size", "2", "--steps", "3", "--output_dir",
                        str(out), "--resume", "auto", *SMALL], tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3 and 2 in steps
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final_model")  # plain, full tensors
    initial = AutoModelForCausalLM.from_pretrained(out / "initial_model")
    assert type(final.lm_head.weight).__name__ == "Parameter"
    assert final.lm_head.weight.shape == initial.lm_head.weight.shape
    assert not torch.equal(final.lm_head.weight, initial.lm_head.weight)  # it trained
    ckpt = torch.load(out / "checkpoints" / "step_000002.pt", weights_only=False)
    assert ckpt["model"]["lm_head.weight"].shape == initial.lm_head.weight.shape
    assert "distributed_config" not in (out / "final_model" / "config.json").read_text()


@pytest.mark.slow
def test_example_runs_on_two_ranks(tmp_path):
    proc = _torchrun([str(ROOT / "examples" / "tensor_parallel.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if not x.startswith("[")]  # DeepSpeed's notes
    assert lines[0].startswith("lm_head.weight: DTensor (Shard(dim=0),), this rank's rows")
    steps = [x for x in lines if x.startswith("step ")]
    assert len(steps) == 4
    assert all("gathering-head calls in scoring and loss: 0" in x for x in steps), steps
    assert lines[-1].startswith("done: 4 steps on 2 ranks")
