"""grpo_train.rewards: answer extraction, number comparison, reward specs, scoring, advantages."""

import math
import sys
import textwrap
import warnings

import pytest
import torch

from grpo_train.rewards import (
    RewardSpec,
    accuracy,
    answers_match,
    combine,
    explain_none,
    extract_answer,
    format_reward,
    group_advantages,
    parse_number,
    parse_reward_spec,
    rewards_failed,
    score,
)


@pytest.mark.parametrize("text, expected", [
    ("so the result is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("<think>3+4</think><answer> 7 </answer>", "7"),
    ("<answer>1</answer> no, <answer>2</answer>", "2"),
    ("Natalia sold 48 clips.\n#### 72", "72"),
    ("first 3 then 12", "12"),
    ("-5", "-5"),
    ("no digits here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_boxed_wins_over_tags_and_hashes():
    assert extract_answer("<answer>1</answer> #### 2 \\boxed{3}") == "3"
    assert extract_answer("<answer>1</answer> #### 2") == "1"


@pytest.mark.parametrize("a, b", [
    ("0.5", "1/2"), ("1,234", "1234"), ("$42", "42"), ("42.", "42"), ("-3", "-3.0"),
    ("\\frac{3}{4}", "0.75"), ("2/4", "1/2"), (".5", "0.5"),
])
def test_numbers_equal(a, b):
    assert answers_match(a, b)


@pytest.mark.parametrize("a, b", [("0.5", "0.51"), ("12", "21"), ("1/3", "0.333"), (None, "1")])
def test_numbers_differ(a, b):
    assert not answers_match(a, b)


def test_parse_number_rejects_text_and_zero_division():
    assert parse_number("abc") is None
    assert parse_number("1/0") is None
    assert parse_number("3 apples and 2 pears") is None  # words after a number, not a second


def test_non_numeric_answers_compare_as_strings():
    assert answers_match(" Paris", "paris")
    assert not answers_match("Lyon", "Paris")


def test_accuracy_reward():
    comps = ["\\boxed{7}", "#### 1,000", "it is 8", "nothing"]
    assert accuracy(["p"] * 4, comps, answer=["7", "1000", "7", "3"]) == [1.0, 1.0, 0.0, 0.0]
    assert accuracy(["p"], ["7"], answer=[None]) == [None]
    assert accuracy(["p"], ["7"]) == [None]  # a dataset without answers cannot be scored


def test_format_reward():
    good = "<think>add them</think>\n<answer>7</answer>"
    assert format_reward(None, [good, "<answer>7</answer>", good + " extra"]) == [1.0, 0.0, 0.0]


def _write_module(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_reward_specs(tmp_path, monkeypatch):
    assert parse_reward_spec("accuracy").fn is accuracy
    spec = parse_reward_spec("format:0.25")
    assert spec.fn is format_reward and spec.weight == 0.25
    path = _write_module(tmp_path, "my_rewards", """
        def length(prompts, completions, **kw):
            return [float(len(c)) for c in completions]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = parse_reward_spec("my_rewards:length:2")
    assert by_module.weight == 2.0 and by_module.fn(None, ["ab"]) == [2.0]
    by_file = parse_reward_spec(f"{path}:length")
    assert by_file.weight == 1.0 and by_file.fn(None, ["abc"]) == [3.0]
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("spec, match", [
    ("no_such_module_xyz:fn", "cannot import"),
    ("grpo_train.rewards:no_such_function", "cannot import"),
    ("missing/file.py:fn", "cannot import"),
    ("accuracyy", "unknown built-in"),
])
def test_bad_reward_spec_is_a_clear_error(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_reward_spec(spec)
    assert "--reward" in str(info.value)


def test_score_survives_failing_and_partial_functions():
    def boom(prompts, completions, **kw):
        raise RuntimeError("bug in user code")

    def partial(prompts, completions, **kw):
        return [None if c == "x" else 1.0 for c in completions]

    def short(prompts, completions, **kw):
        return [1.0]

    specs = [parse_reward_spec("accuracy")]
    for fn in (boom, partial, short):
        specs.append(type(specs[0])(fn.__name__, fn, 1.0))
    rewards, failures = score(specs, ["p"] * 3, ["1", "x", "2"], {"answer": ["1", "1", "1"]})
    assert rewards.shape == (3, 4)
    assert rewards[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert torch.isnan(rewards[:, 1]).all() and torch.isnan(rewards[:, 3]).all()
    assert torch.isnan(rewards[1, 2]) and rewards[0, 2] == 1.0
    assert failures["partial"] == 1
    assert any("boom" in k and "bug in user code" in k for k in failures)
    assert any(k.startswith("short") for k in failures)


def test_trl_style_functions_get_keyword_arguments():
    """TRL calls reward functions with keywords, so its documented `f(completions, **kwargs)`
    form is common; called positionally, such a function raised TypeError and scored nothing."""
    def digits(completions, **kwargs):
        return [float(c.isdigit()) for c in completions]

    def by_answer(completions, answer, prompts, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]

    specs = [RewardSpec("digits", digits), RewardSpec("by_answer", by_answer)]
    rewards, failures = score(specs, ["p", "q"], ["1", "x"], {"answer": ["1", "1"]})
    assert failures == {}
    assert rewards.tolist() == [[1.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize("returned, what", [
    (1.0, "float"), (None, "NoneType"), ("1010", "str"), ({"a": 1.0}, "dict"),
])
def test_a_function_that_returns_no_list_is_named_with_what_it_returned(returned, what):
    """A scalar or None read "TypeError: 'float' object is not iterable", as if the function
    itself had raised; a 4-character string was taken as 4 rewards."""
    rewards, failures = score([RewardSpec("odd", lambda **kw: returned)], ["p"] * 4, ["a"] * 4,
                              {})
    assert torch.isnan(rewards).all()
    assert list(failures) == [f"odd: ValueError: returned a {what}; expected a list of 4 "
                              "rewards, one per completion"]


@pytest.mark.parametrize("values, named", [
    (["1.0", "0", "abc", "1"], "returned a str ('1.0') for completion 0 (4 of 4 not numbers)"),
    ([1.0, None, b"x", 0.0], "returned a bytes (b'x') for completion 2 (1 of 4 not numbers)"),
    ([1.0, [0.5], 0.0, {}], "returned a list ([0.5]) for completion 1 (2 of 4 not numbers)"),
    ([1.0, 0.0, 1j, 0.0], "returned a complex (1j) for completion 2 (1 of 4 not numbers)"),
])
def test_values_that_are_not_numbers_are_named_with_their_type(values, named):
    """A function returning strings was logged as returning None ("odd": 4, unscored without a
    reason), and "1.0" was read as 1.0: a value that is neither a number nor None is now the
    function failing on the batch, logged with the type it returned."""
    rewards, failures = score([RewardSpec("odd", lambda **kw: values)], ["p"] * 4, ["a"] * 4,
                              {})
    assert torch.isnan(rewards).all()
    assert list(failures) == [f"odd: TypeError: {named}; expected a number or None (unscored) "
                              "per completion"]
    assert f"odd: TypeError: {named}" in str(rewards_failed(failures, 1, 1, 4, None))


def test_numbers_of_every_kind_and_none_are_rewards():
    import numpy as np

    values = [True, 2, np.float32(0.5), np.int64(3), torch.tensor(1.5), None]
    rewards, failures = score([RewardSpec("ok", lambda **kw: values)], ["p"] * 6, ["a"] * 6, {})
    assert rewards[:5, 0].tolist() == [1.0, 2.0, 0.5, 3.0, 1.5] and torch.isnan(rewards[5, 0])
    assert failures == {"ok": 1}


def test_none_is_explained_once_per_function():
    said = set()
    note = explain_none({"accuracy": 3, "boom: RuntimeError: x": 4}, said)
    assert note.startswith("note: accuracy returned None for some completions: None means")
    assert "a row without an answer" in note and "unscored (advantage 0" in note
    assert explain_none({"accuracy": 5}, said) is None
    assert explain_none({"accuracy": 1, "mine": 2}, said).startswith("note: mine returned None")
    assert explain_none({"boom: RuntimeError: x": 4}, said) is None


def test_tensors_and_arrays_are_lists_of_rewards():
    """A tensor that requires grad warned once per reward (float() of a grad-tracking tensor)."""
    import numpy as np

    for returned in (torch.tensor([1.0, 0.0], requires_grad=True), np.array([1, 0])):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rewards, failures = score([RewardSpec("t", lambda r=returned, **kw: r)], ["p"] * 2,
                                      ["a"] * 2, {})
        assert rewards[:, 0].tolist() == [1.0, 0.0] and failures == {}


def test_infinite_and_nan_rewards_leave_completions_unscored():
    """An inf reward used to be kept: its group's advantages became NaN, then 0 (the group
    trained on nothing) and the step's reward read inf, with no failure counted."""
    def odd(prompts, completions, **kw):
        return [float("inf"), -math.inf, float("nan"), 1.0]

    rewards, failures = score([RewardSpec("odd", odd)], ["p"] * 4, ["a"] * 4, {})
    assert torch.isnan(rewards[:3, 0]).all() and rewards[3, 0] == 1.0
    assert failures == {"odd: non-finite rewards (inf or NaN)": 3}
    message = str(rewards_failed(failures, 1, 1, 4, None))
    assert "odd: non-finite rewards (inf or NaN) (3 of 4 completions)" in message


def test_combine_weights_and_unscored_rows():
    per_func = torch.tensor([[1.0, 0.5], [float("nan"), 1.0], [float("nan"), float("nan")]])
    total = combine(per_func, torch.tensor([2.0, 1.0]))
    assert total[0] == 2.5 and total[1] == 1.0 and torch.isnan(total[2])


def _advantages_by_hand(rewards, G, scale):
    """An independent, loop-based reading of docs/semantics.md's advantage formula."""
    def stats(values):
        vals = [v for v in values if not math.isnan(v)]
        mean = sum(vals) / len(vals) if vals else math.nan
        std = (math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
               if len(vals) > 1 else math.nan)
        return mean, std

    r = rewards.tolist()
    _, batch_std = stats(r)
    out = []
    for g in range(0, len(r), G):
        group = r[g:g + G]
        mean, std = stats(group)
        for v in group:
            a = v - mean
            if scale == "group":
                a = a / (std + 1e-4)
            elif scale == "batch":
                a = a / (batch_std + 1e-4)
            out.append(0.0 if math.isnan(a) else a)
    return torch.tensor(out)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_the_spec(scale):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 4, generator=gen) * 3
    rewards[[1, 9, 10, 11]] = float("nan")  # unscored, and one group with a single score
    rewards[12:16] = 0.5  # all equal: no signal
    adv = group_advantages(rewards, 4, scale)
    torch.testing.assert_close(adv, _advantages_by_hand(rewards, 4, scale))
    assert adv[1] == 0 and (adv[8:16] == 0).all()  # NaN -> 0; lone score and ties -> 0
    assert adv.abs().sum() > 0


def test_group_advantages_agree_with_trl_nanstd():
    utils = pytest.importorskip("trl.trainer.utils")
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, float("nan"), 0.0, 1.0])
    grouped = rewards.view(-1, 4)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    expected = (grouped - mean) / (utils.nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 4),
                               torch.nan_to_num(expected.reshape(-1), nan=0.0))


def test_group_advantages_rejects_partial_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
