"""--max_unscored_steps: a run stops after that many steps in a row in which no completion was
scored, with an error naming each reward function's failure; the checkpoint written before the
failures is kept; a reward that fails once, or on some completions only, does not stop a run."""

import textwrap

import pytest
from test_cli import TINY_RUN
from test_train_loop import records, tiny_cfg

from grpo_train import TrainConfig, main, parse_config, resolve_auto, train
from grpo_train.checkpoint import checkpoint_dir, list_checkpoints, load_checkpoint
from grpo_train.checks import validate
from grpo_train.flags import UsageError
from grpo_train.logs import read_metrics
from grpo_train.rewards import RewardsFailedError

REWARDS = """
def breaks_after_2(prompts, completions, **columns):
    # scores the first two steps, then fails on every call (a reward server gone for good)
    global breaks_calls
    breaks_calls = globals().get("breaks_calls", 0) + 1
    if breaks_calls > 2:
        raise RuntimeError("reward server down")
    return [float(len(c) % 3) for c in completions]


def every_other_step(prompts, completions, **columns):
    # fails on odd steps only: never two failing steps in a row
    global other_calls
    other_calls = globals().get("other_calls", 0) + 1
    if other_calls % 2:
        raise ValueError("flaky")
    return [float(len(c) % 3) for c in completions]


def boom(prompts, completions, **columns):
    raise RuntimeError("bug in user code")


def some_unscored(prompts, completions, **columns):
    return [None if i % 2 else float(len(c) % 3) for i, c in enumerate(completions)]


def strings(prompts, completions, **columns):
    return [str(len(c) % 3) for c in completions]


def always_none(prompts, completions, **columns):
    return [None] * len(completions)
"""


@pytest.fixture
def helper(tmp_path):
    path = tmp_path / "stop_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def saved_steps(cfg) -> list[int]:
    return [load_checkpoint(p)["step"] for p in list_checkpoints(checkpoint_dir(cfg.output_dir))]


def test_stops_after_n_unscored_steps_and_keeps_the_last_checkpoint(tmp_path, helper):
    """Steps 1-2 scored and saved; steps 3-5 unscored: the run stops after step 5. keep 1 and a
    save every step: a save during the failures would have deleted step 2's checkpoint."""
    cfg = tiny_cfg(tmp_path, reward=[f"{helper}:breaks_after_2"], steps=10, save_every=1,
                   keep_checkpoints=1, max_unscored_steps=3)
    with pytest.raises(RewardsFailedError) as info:
        train(cfg)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, UsageError)
    message = str(info.value)
    assert "no completion was scored in 3 consecutive steps (steps 3-5" in message
    assert "breaks_after_2: RuntimeError: reward server down (16 of 16 completions)" in message
    assert [r["step"] for r in records(cfg)] == [1, 2, 3, 4, 5]
    assert [r["unscored"] for r in records(cfg)] == [0, 0, 16, 16, 16]
    assert saved_steps(cfg) == [2]
    kept = list_checkpoints(checkpoint_dir(cfg.output_dir))[0]
    assert f"the last checkpoint, {kept}, is kept" in message and "--resume auto" in message


def test_functions_returning_none_everywhere_stop_too(tmp_path, helper):
    cfg = tiny_cfg(tmp_path, reward=[f"{helper}:always_none"], steps=3, save_every=1,
                   max_unscored_steps=1)
    with pytest.raises(RewardsFailedError) as info:
        train(cfg)
    message = str(info.value)
    assert "in 1 consecutive steps (step 1," in message
    assert "always_none returned None for 16 of 16 completions" in message
    assert "no checkpoint was written" in message
    assert [r["step"] for r in records(cfg)] == [1] and saved_steps(cfg) == []


def test_a_function_returning_strings_stops_with_its_type(tmp_path, helper):
    """Strings were counted as None: "strings returned None for 16 of 16 completions"."""
    cfg = tiny_cfg(tmp_path, reward=[f"{helper}:strings"], steps=3, max_unscored_steps=1)
    with pytest.raises(RewardsFailedError) as info:
        train(cfg)
    assert "strings: TypeError: returned a str (" in str(info.value)
    assert "(16 of 16 not numbers)" in str(info.value)


@pytest.mark.parametrize("reward, limit, unscored", [
    (["every_other_step"], 2, [16, 0, 16, 0, 16]),  # fails once at a time: the count resets
    (["some_unscored"], 1, [8] * 5),  # some completions scored in every step
    (["accuracy", "boom"], 1, [0] * 5),  # one function always fails, the other scores
    (["boom"], 0, [16] * 5),  # 0: never stop
], ids=["once-at-a-time", "some-completions", "one-of-two-functions", "zero-never-stops"])
def test_partial_or_passing_failures_do_not_stop(tmp_path, helper, capsys, reward, limit,
                                                 unscored):
    specs = [r if r == "accuracy" else f"{helper}:{r}" for r in reward]
    cfg = tiny_cfg(tmp_path, reward=specs, steps=5, max_unscored_steps=limit)
    result = train(cfg)
    assert result["step"] == 5 and not result["interrupted"]
    assert [r["unscored"] for r in records(cfg)] == unscored
    assert all("reward_failures" in r for r in records(cfg) if r["unscored"] or "boom" in reward)
    out = capsys.readouterr().out
    assert "warning: unscored completions at step 1" in out
    # None is unscored by design: said once per run, not at every step
    assert out.count("returned None for some completions") == (reward == ["some_unscored"])


@pytest.mark.parametrize("limit, saved", [(2, [2, 4]), (0, [1, 2, 3, 4])])
def test_checkpoints_wait_for_a_scored_step_while_a_stop_may_come(tmp_path, helper, limit,
                                                                  saved):
    """Steps 1 and 3 score nothing: with a stop possible their saves wait for steps 2 and 4;
    with --max_unscored_steps 0 every step saves as usual."""
    cfg = tiny_cfg(tmp_path, reward=[f"{helper}:every_other_step"], steps=4, save_every=1,
                   keep_checkpoints=10, max_unscored_steps=limit)
    assert train(cfg)["step"] == 4
    assert saved_steps(cfg) == saved


def test_a_run_ending_in_unscored_steps_keeps_the_earlier_checkpoint(tmp_path, helper):
    """Steps 3-4 unscored, fewer than the limit: the run ends as usual and saves its last step
    for a resume, without deleting step 2's checkpoint (keep 1 would have)."""
    cfg = tiny_cfg(tmp_path, reward=[f"{helper}:breaks_after_2"], steps=4, save_every=1,
                   keep_checkpoints=1, max_unscored_steps=3)
    assert train(cfg)["step"] == 4
    assert saved_steps(cfg) == [2, 4]


def test_the_command_line_exits_2_with_one_line(tmp_path, helper, capsys):
    argv = [*TINY_RUN, "--steps", "5", "--output_dir", str(tmp_path / "run"),
            "--reward", f"{helper}:boom", "--max-unscored-steps", "2"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-train: error: --reward: no completion was "
                                               "scored in 2 consecutive steps (steps 1-2"), err
    assert "boom: RuntimeError: bug in user code (4 of 4 completions)" in err[0]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("value", [-1, 2.5, True, "3"])
def test_bad_values_name_the_option(value):
    with pytest.raises(UsageError, match=r"--max_unscored_steps must be a whole number of steps "
                       rf">= 0 \(0 = never stop\), got {value!r}"):
        validate(resolve_auto(TrainConfig(max_unscored_steps=value)))


def test_command_line_and_config_file_values(tmp_path, capsys):
    assert TrainConfig().max_unscored_steps == 3
    assert parse_config(["--max_unscored_steps", "0"]).max_unscored_steps == 0
    with pytest.raises(UsageError, match="--max_unscored_steps must be a whole number"):
        parse_config(["--max_unscored_steps", "-2"])
    with pytest.raises(SystemExit) as info:
        parse_config(["--max_unscored_steps", "x"])
    assert info.value.code == 2
    assert "argument --max_unscored_steps: invalid int value: 'x'" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_unscored_steps: 1.5\n")
    with pytest.raises(UsageError, match="max_unscored_steps must be int, got 1.5"):
        parse_config(["--config", str(bad)])
