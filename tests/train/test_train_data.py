"""grpo_train.data on the files users bring: blank and odd cells, splits of a local file, chat
prompts, and how the held-out rows are chosen."""

import json

from grpo_train.data import parse_gsm8k_answer, read_rows, to_examples


def _jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_blank_answers_are_no_answers(tmp_path):
    """A CSV row with an empty answer cell kept "" as its truth (and an empty \\boxed{} scored
    1); a null or blank answer is None, unscored and left out of held-out accuracy."""
    path = tmp_path / "d.csv"
    path.write_text("question,answer\nq1,\nq2, \nq3,#### 7\nq4\n")
    examples = to_examples(read_rows(str(path), None, "train"), "question", "answer", "x")
    assert [e["answer"] for e in examples] == [None, None, "7", None]


def test_gsm8k_answer_is_after_the_last_marker():
    assert parse_gsm8k_answer("a #### 10\nb #### 2,000") == "2000"
    assert parse_gsm8k_answer("#### ") == ""
