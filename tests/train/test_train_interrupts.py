"""Ctrl-C while a checkpoint is being written: the save finishes, and the run stops at its step.

The signal is sent from inside torch.save (patched), the moment a real Ctrl-C during a save of
a large model would most likely land."""

import os
import signal

import pytest
import torch

from grpo_train import train
from grpo_train.checkpoint import list_checkpoints
from tests.train.test_train_loop import records, tiny_cfg


@pytest.fixture
def ctrl_c_in_save(monkeypatch):
    """Ctrl-C the moment the checkpoint of step `steps[0]` starts to be written."""
    steps, save = [], torch.save

    def save_and_interrupt(obj, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") in steps:
            os.kill(os.getpid(), signal.SIGINT)
        return save(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_and_interrupt)
    return steps


def _checkpoints(cfg):
    return [p.name for p in list_checkpoints(f"{cfg.output_dir}/checkpoints")]


def test_ctrl_c_during_the_last_save_keeps_the_checkpoint(tmp_path, ctrl_c_in_save):
    """The save after the last step ran without the Ctrl-C handler: one Ctrl-C aborted it in
    mid-write (KeyboardInterrupt), and a run without scheduled checkpoints lost every step."""
    ctrl_c_in_save.append(2)
    cfg = tiny_cfg(tmp_path, steps=2, save_every=5, num_iterations=1)
    try:
        result = train(cfg)
    except KeyboardInterrupt:  # (not raised on: it would end the whole pytest session)
        pytest.fail("one Ctrl-C aborted the checkpoint in mid-write")
    assert result["step"] == 2 and not result["interrupted"]  # every step ran: complete
    assert _checkpoints(cfg) == ["step_000002.pt"]


def test_ctrl_c_during_a_scheduled_save_stops_at_its_step(tmp_path, ctrl_c_in_save):
    """Ctrl-C during the save of step 2 trained a whole step 3 before stopping; the run now
    stops at step 2, its checkpoint written, and resumes to the uninterrupted run's metrics."""
    common = dict(steps=4, save_every=2, keep_checkpoints=1, num_iterations=1, beta=0.1)
    straight = tiny_cfg(tmp_path / "a", **common)
    train(straight)
    ctrl_c_in_save.append(2)
    cfg = tiny_cfg(tmp_path / "b", **common)
    result = train(cfg)
    assert (result["step"], result["interrupted"]) == (2, True)
    assert _checkpoints(cfg) == ["step_000002.pt"]
    assert [r["step"] for r in records(cfg)] == [1, 2]
    ctrl_c_in_save.clear()
    assert train(tiny_cfg(tmp_path / "b", resume="auto", **common))["step"] == 4
    assert _checkpoints(cfg) == ["step_000004.pt"]  # --keep_checkpoints 1 pruned step 2
    timing = {"tokens_per_s", "peak_memory_gib", "step_time_s"}
    got, want = records(cfg), records(straight)
    assert [{k: v for k, v in r.items() if k not in timing} for r in got] == [
        {k: v for k, v in r.items() if k not in timing} for r in want]


def test_ctrl_c_during_the_last_step_completes_the_run(tmp_path):
    """Ctrl-C during the last step marked the run interrupted: no final model, exit 130 and
    "continue with --resume auto", whose answer was "the run is complete", so the final model
    was never written. The run now ends as its last step would have ended it."""
    helper = tmp_path / "last_step_interrupt.py"
    helper.write_text(
        "import os, signal\n"
        "calls = 0\n"
        "def interrupt_second(prompts, completions, **columns):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 2:  # step 2 of 2\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return [float(len(c) % 3) for c in completions]\n")
    cfg = tiny_cfg(tmp_path, steps=2, num_iterations=1, save_final_model=True,
                   reward=[f"{helper}:interrupt_second"])
    result = train(cfg)
    assert result["step"] == 2 and not result["interrupted"]
    assert (tmp_path / "run" / "final_model" / "config.json").exists()
