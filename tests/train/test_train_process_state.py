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
