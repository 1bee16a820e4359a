"""Data-parallel training: `accelerate launch` with two CPU processes (gloo). Both ranks must end
with identical parameters (DDP averaged their gradients) after training on different prompts."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

RECORDER = """
import os

def record(prompts, completions, **columns):
    # which prompts this process scored, one line per step
    with open(os.path.join(os.environ["GRPO_TEST_DIR"], f"prompts_{os.environ['RANK']}.txt"),
              "a") as fh:
        fh.write("|".join(sorted(set(prompts))) + "\\n")
    return [float(len(c) % 2) for c in completions]
"""

DRIVER = """
import os, sys
import torch
from grpo_train.cli import parse_config
from grpo_train import train
import grpo_train

# the code under test, not an installed copy of another checkout
assert grpo_train.__file__.startswith(os.environ["GRPO_TEST_REPO"]), grpo_train.__file__

result = train(parse_config(sys.argv[1:]))  # what `python -m grpo_train` runs
state = {k: v.detach().cpu() for k, v in result["model"].state_dict().items()}
torch.save(state, os.path.join(os.environ["GRPO_TEST_DIR"], f"params_{os.environ['RANK']}.pt"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("batching", [
    [],  # sequence-count micro-batches of padded rows
    # packed rows cut by a small token budget: the ranks' completions differ in length, so their
    # micro-batch counts would too; they agree on the maximum (a mismatch would hang DDP)
    ["--padding_free", "--no_share_prompt", "--max_tokens_per_microbatch", "16"],
    # the same with each group's prompt once (the default layout)
    ["--padding_free", "--max_tokens_per_microbatch", "16"],
], ids=["padded", "packed-budget", "shared-budget"])
def test_two_processes_stay_in_sync_on_different_prompts(tmp_path, batching):
    (tmp_path / "recorder.py").write_text(textwrap.dedent(RECORDER))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(driver),
           "--output_dir", str(out), "--steps", "3", "--num_prompts", "4",
           "--num_generations", "4", "--max_new_tokens", "3", "--format_warmup_steps", "2",
           "--tiny_hidden_size", "32", "--task_terms", "2", "--task_max_operand", "5",
           "--num_iterations", "2", "--micro_batch_size", "4", "--eval_every", "3",
           "--save_every", "3", "--backend", "chunked", "--no-progress", "--no-plot",
           "--num_threads", "1", "--device", "cpu", *(batching or ["--no_padding_free"]),
           "--reward", "accuracy", f"{tmp_path / 'recorder.py'}:record:0.1"]
    env = dict(os.environ, GRPO_TEST_DIR=str(tmp_path), OMP_NUM_THREADS="1",
               GRPO_TEST_REPO=str(REPO),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    ranks = [torch.load(tmp_path / f"params_{r}.pt") for r in (0, 1)]
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(out / "initial_model").state_dict()
    assert any(not torch.equal(start[k], ranks[0][k]) for k in start)  # it did train

    steps = [(tmp_path / f"prompts_{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert len(steps[0]) == len(steps[1]) == 3
    for mine, theirs in zip(*steps):
        assert mine and theirs and not set(mine.split("|")) & set(theirs.split("|"))
    assert (out / "checkpoints" / "step_000003.pt").exists()
    assert "eval_acc" in proc.stdout + proc.stderr
    layout = ("padded" if not batching else "packed rows" if "--no_share_prompt" in batching
              else "shared rows")
    assert f"micro-batches: {layout}" in proc.stdout + proc.stderr
