"""What a run sets for the whole process, seen from a Python caller of `grpo_train.train`: the
run's own settings end with the run."""

import torch

from grpo_train import train
from tests.train.test_train_loop import tiny_cfg


def test_train_gives_the_callers_thread_count_back(tmp_path):
    """--num_threads 1 is the run's: train() left the caller's process on one thread (a
    notebook's work after a run ran single-threaded)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(tiny_cfg(tmp_path, steps=1, num_iterations=1, num_threads=1))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_run_says_each_route_once_with_its_reason(tmp_path, capsys, monkeypatch):
    """The kernels log their route on the "grpo_kernels" logger at INFO, which a run of
    grpo_train configured no handler for: its output never said which route the loss took.
    Each route is said once, with its reason, also the format warm-up's (before the run's
    printer exists); the logger is the caller's again after the run."""
    import logging

    from grpo_kernels.ops import route

    monkeypatch.setattr(route, "_LOGGED", set())  # a fresh process's: nothing logged yet
    logger = logging.getLogger("grpo_kernels")
    before = (logger.level, list(logger.handlers))
    train(tiny_cfg(tmp_path, steps=2, num_iterations=1, num_threads=1))
    lines = [x for x in capsys.readouterr().out.splitlines() if " route: " in x]
    assert len(lines) == len(set(lines)), lines
    assert any("linear-head loss on the three-pass route: scalar loss" in x for x in lines), lines
    assert any("selective log-probs on the four-pass route: a gradient" in x for x in lines)
    assert (logger.level, list(logger.handlers)) == before
