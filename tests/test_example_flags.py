"""The examples' command lines: a wrong value or an unknown flag is refused by the parser, with
the flag named, before any model is built."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_example(name: str):
    pytest.importorskip("trl" if name == "trl_swap" else "transformers")
    if name == "lora_head":
        pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() is not run
    return module


@pytest.mark.parametrize("argv, flag", [
    (["--loss_type", "bogus"], "--loss_type"),  # TRL itself raised only at the first loss
    (["--loss_type", "gmpo"], "--loss_type"),  # grpo_kernels' own, not TRL's
    (["--steps", "0"], "--steps"),  # TRL would train 1 step
    (["--steps", "-1"], "--steps"),  # TRL's max_steps=-1: a whole epoch (12 steps)
    (["--beta", "nan"], "--beta"),
])
def test_trl_swap_refuses_bad_values(argv, flag, capsys):
    trl_swap = load_example("trl_swap")
    with pytest.raises(SystemExit) as exit_info:
        trl_swap.parse_args(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_trl_swap_takes_every_trl_loss_type():
    from grpo_kernels.loss_specs import TRL_LOSS_TYPES

    trl_swap = load_example("trl_swap")
    assert "vespo" in TRL_LOSS_TYPES
    for loss_type in TRL_LOSS_TYPES:
        assert trl_swap.parse_args(["--loss_type", loss_type]).loss_type == loss_type
    opts = trl_swap.parse_args([])
    assert (opts.steps, opts.loss_type, opts.beta, opts.padded, opts.compare) == (
        3, "dapo", 0.04, False, False)


@pytest.mark.parametrize("name", ["hf_plain_pytorch", "lora_head"])
def test_examples_without_flags_refuse_arguments(name, capsys):
    example = load_example(name)
    assert example.parse_args([]) is not None
    with pytest.raises(SystemExit) as exit_info:  # once ignored: the example ran as if bare
        example.parse_args(["--steps", "2"])
    assert exit_info.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_tensor_parallel_outside_torchrun_says_how_to_start(monkeypatch):
    """Started as a plain script (no RANK from torchrun) it says how to run it, not a traceback
    from the process group's environment lookup."""
    tensor_parallel = load_example("tensor_parallel")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun --nproc_per_node 2"):
        tensor_parallel.main()
