"""grpo_train.rewards' answer reading on realistic model outputs: what counts as the same number,
and the look-alikes that must not."""

import pytest

from grpo_train.rewards import (
    accuracy,
    answers_match,
    extract_answer,
    format_reward,
    parse_number,
)


@pytest.mark.parametrize("predicted, truth", [
    ("1,2", "12"), ("3,4", "34"), ("3, 4", "34"), ("1 2", "12"), ("10,00", "1000"),
    ("1,0/20", "0.5"), ("1,2345", "12345"), ("(3, 4)", "34"),
])
def test_commas_and_spaces_do_not_join_numbers(predicted, truth):
    """Commas were dropped wherever they stood and spaces too, so the pair "3, 4" or a European
    decimal "1,2" read as 34 or 12: a false positive. Thousands separators come in threes."""
    assert not answers_match(predicted, truth)


@pytest.mark.parametrize("predicted, truth", [
    ("1,000", "1000"), ("12,345,678", "12345678"), ("-1,234.5", "-1234.5"), ("- 3", "-3"),
    ("1 / 2", "0.5"), ("1e3", "1000"), ("2.5E-1", "1/4"), ("\u22125", "-5"),
])
def test_numbers_that_are_the_same(predicted, truth):
    assert answers_match(predicted, truth)


@pytest.mark.parametrize("text, expected", [
    ("The answer is \u22125", "-5"),  # a Unicode minus sign (U+2212)
    ("pages 3-4", "4"),  # a hyphen between numbers is no sign
    ("so x = -4", "-4"),
    ("It is 1e3", "1e3"), ("about 1.5E-3", "1.5E-3"),
    ("we get 1,2345", "2345"), ("the list 1,2,3", "3"), ("total: 1,234,567.", "1,234,567"),
    ("\\boxed{\u22127}", "-7"),
])
def test_the_last_number_is_read_whole(text, expected):
    assert extract_answer(text) == expected


def test_look_alike_last_numbers_are_not_rewarded():
    """"−5" read as 5, "3-4" as -4 and "1e3" as 3: each scored right against the wrong truth."""
    texts = ["The answer is \u22125", "pages 3-4", "It is 1e3", "the list 1,2,3"]
    assert accuracy(None, texts, answer=["5", "-4", "3", "123"]) == [0.0] * 4
    assert accuracy(None, texts, answer=["-5", "4", "1000", "3"]) == [1.0] * 4


def test_huge_exponents_and_digit_strings_are_not_numbers():
    assert parse_number("1e999999999") is None  # would build a billion-digit integer
    assert parse_number("9" * 5000) is None  # beyond Python's int parsing limit
    assert extract_answer("x" * 100_000 + " 7") == "7"  # long outputs read fine


def test_a_blank_truth_is_no_truth():
    """An empty answer cell (a CSV row without it) equalled an empty \\boxed{} or <answer></answer>:
    completions were rewarded for answering nothing."""
    texts = ["\\boxed{}", "<answer> </answer>", "7"]
    assert accuracy(None, texts, answer=["", " ", ""]) == [None, None, None]
    assert not answers_match("", "")


@pytest.mark.parametrize("boxed, truth", [
    ("\\$42", "42"), ("\\$1{,}000", "1000"), ("1\\,000", "1000"), ("42\\%", "42"),
    ("50%", "50"), ("42 \\text{ dollars}", "42"), ("42\\text{ dollars}", "42"), ("\\text{5}", "5"),
    ("\\textbf{18}", "18"), ("5 apples", "5"), ("12 km.", "12"), ("x = 5", "5"),
    ("\\frac12", "0.5"), ("\\tfrac{1}{4}", "0.25"), ("-\\dfrac{3}{4}", "-0.75"),
    ("90^\\circ", "90"), ("5 red apples", "5"),
])
def test_boxed_answers_with_units_and_latex(boxed, truth):
    """Answers models write inside \\boxed{} with a currency, percent or unit, or wrapped in
    \\text{}, scored 0 against the plain ground truth."""
    assert accuracy(None, [f"so \\boxed{{{boxed}}}."], answer=[truth]) == [1.0]


@pytest.mark.parametrize("boxed, truth", [
    ("5 or 6", "6"), ("5 or 6", "5 or 7"), ("x = 5", "6"), ("2 \\text{ and } 3", "3"), ("5x", "5"),
    ("\\frac{1}{2} + 1", "0.5"), ("50\\%", "0.5"), ("y = 2x", "2"),
])
def test_units_and_latex_do_not_hide_other_answers(boxed, truth):
    assert accuracy(None, [f"\\boxed{{{boxed}}}"], answer=[truth]) == [0.0]


def test_format_wants_one_think_block_then_one_answer_block():
    """The lazy ".*?" spanned tags: two answer blocks, or two think blocks, passed as the
    format."""
    ok = ["<think>add</think><answer>7</answer>", " <think>\na\n</think>\n<answer>\n7\n</answer>\n"]
    bad = ["<think>a</think><answer>3</answer><answer>4</answer>",
           "<think>a</think><think>b</think><answer>7</answer>",
           "<think>a<answer>3</answer></think><answer>7</answer>",
           "<think>a</think>7", "a</think><answer>7</answer>", "<answer>7</answer>"]
    assert format_reward(None, ok + bad) == [1.0] * len(ok) + [0.0] * len(bad)
