"""grpo_train.data on the files users bring: blank and odd cells, splits of a local file, chat
prompts, and how the held-out rows are chosen."""

import json
import re
import sys

import pytest

from grpo_train import data
from grpo_train.checks import validate
from grpo_train.config import TrainConfig, resolve_auto
from grpo_train.data import load_examples, parse_gsm8k_answer, read_rows, to_examples
from grpo_train.flags import UsageError


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


@pytest.mark.parametrize("flag, split", [("eval_split", "test"), ("split", "validation")])
def test_a_local_file_has_no_splits(tmp_path, flag, split):
    """A local file's rows were returned for any split: --eval_split test held out the training
    rows themselves, so "held-out" accuracy was measured on the training prompts."""
    path = _jsonl(tmp_path, [{"q": f"p{i}", "a": str(i)} for i in range(20)])
    cfg = TrainConfig(dataset=path, prompt_column="q", answer_column="a", **{flag: split})
    with pytest.raises(UsageError, match=f"--{flag} '{split}': --dataset .* is a local file"):
        load_examples(cfg)


def test_eval_split_rows_of_a_hub_dataset(monkeypatch):
    """--eval_split reads that split; auto keeps its first 200 rows, a number N its first N."""
    def read_hub(name, config, split):
        n = {"train": 50, "test": 300}[split]
        return [{"q": f"{split}{i}", "a": str(i)} for i in range(n)]

    monkeypatch.setattr(data, "_read_hub", read_hub)
    for eval_size, held in [(None, 200), (7, 7), (0, 0)]:
        cfg = TrainConfig(dataset="org/set", eval_split="test", prompt_column="q",
                          answer_column="a", eval_size=eval_size)
        train, held_out = load_examples(cfg)
        assert (len(train), len(held_out)) == (50, held), eval_size
        assert all(ex["q"].startswith("test") for ex in held_out)
    # --eval_split naming the training split held out the training rows themselves
    with pytest.raises(UsageError, match="--eval_split 'train' is the training split"):
        load_examples(TrainConfig(dataset="org/set", eval_split="train", prompt_column="q",
                                  answer_column="a"))


def test_columns_of_unequal_length_are_an_error(tmp_path):
    """{"question": [3 items], "answer": [2 items]} silently dropped the third question."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"question": ["a", "b", "c"], "answer": ["1", "2"]}))
    with pytest.raises(UsageError, match="columns of different lengths.*'question': 3.*"
                                         "'answer': 2"):
        read_rows(str(path), None, "train")


@pytest.mark.parametrize("ext", ["csv", "json", "jsonl"])
def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path, ext):
    """Files saved by spreadsheet programs start with a UTF-8 byte order mark: the CSV's first
    column read as '\\ufeffquestion' (no column 'question'), and JSON did not parse."""
    path = tmp_path / f"d.{ext}"
    text = {"csv": "question,answer\nq1,1\n",
            "json": json.dumps([{"question": "q1", "answer": "1"}]),
            "jsonl": json.dumps({"question": "q1", "answer": "1"}) + "\n"}[ext]
    path.write_text(text, encoding="utf-8-sig")
    examples = to_examples(read_rows(str(path), None, "train"), "question", "answer", "x")
    assert examples[0]["prompt"] == "q1" and examples[0]["answer"] == "1"


def test_a_json_object_of_scalars_is_one_row(tmp_path):
    """{"question": "abc", "answer": "12"} was read as columns of characters: one row "a", "1"."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"question": "abc", "answer": "12"}))
    assert read_rows(str(path), None, "train") == [{"question": "abc", "answer": "12"}]


def test_json_lines_split_at_newlines_only(tmp_path):
    """A prompt holding U+2028 (JSON allows it raw) in JSON lines saved as .json was cut in two
    by str.splitlines."""
    path = tmp_path / "d.json"
    row = {"question": "line one\u2028line two", "answer": "1"}
    path.write_text(2 * (json.dumps(row, ensure_ascii=False) + "\n"), encoding="utf-8")
    assert read_rows(str(path), None, "train") == [row, row]


@pytest.mark.parametrize("prompt, got", [
    ([], "an empty list"),
    (["1+1"], "item 1 is '1+1'"),
    ([{"role": "user", "content": "1+1"}, {"content": "2+2"}], "item 2 has no 'role'"),
])
def test_chat_prompts_are_lists_of_messages(tmp_path, prompt, got):
    """A list prompt that is not chat messages passed the load; the step then rendered it as
    nothing or failed (an IndexError or AttributeError, after the model had loaded)."""
    path = _jsonl(tmp_path, [{"question": [{"role": "user", "content": "3+4"}]},
                             {"question": prompt}])
    with pytest.raises(UsageError, match=f"--dataset x row 2: --prompt_column 'question' must "
                                         f"be .*messages.*{re.escape(got)}"):
        to_examples(read_rows(path, None, "train"), "question", "", "--dataset x")
    good = to_examples(read_rows(path, None, "train")[:1], "question", "", "--dataset x")
    assert good[0]["prompt"] == [{"role": "user", "content": "3+4"}]


def test_columns_are_those_of_every_row(tmp_path):
    """JSON lines whose first row lacked the answer were refused: "no column 'answer'"."""
    path = _jsonl(tmp_path, [{"question": "a"}, {"question": "b", "answer": "#### 2"}])
    examples = to_examples(read_rows(path, None, "train"), "question", "answer", "x")
    assert [e["answer"] for e in examples] == [None, "2"]


def test_copies_of_a_prompt_are_held_out_together(tmp_path):
    """Rows were held out one by one, so a prompt repeated in the file (a common shape: one row
    per sampled answer, or a dataset concatenated with itself) was trained on and evaluated on,
    inflating held-out accuracy. Every copy goes to one side, and --eval_size counts prompts."""
    rows = [{"q": f"p{i % 10}", "a": str(i % 10)} for i in range(40)]  # each prompt 4 times
    rows.append({"q": [{"role": "user", "content": "chat"}], "a": "1"})
    rows.append({"q": [{"content": "chat", "role": "user"}], "a": "1"})  # same messages
    path = _jsonl(tmp_path, rows)
    for seed in range(5):
        cfg = TrainConfig(dataset=path, prompt_column="q", answer_column="a", eval_size=3,
                          seed=seed)
        train, held_out = load_examples(cfg)
        held = {json.dumps(ex["prompt"], sort_keys=True) for ex in held_out}
        trained = {json.dumps(ex["prompt"], sort_keys=True) for ex in train}
        assert not held & trained, seed
        assert len(held) == 3 and len(train) + len(held_out) == 42
        assert load_examples(cfg) == (train, held_out)  # deterministic per seed
    with pytest.raises(UsageError, match="--eval_size 11 leaves no training prompts out of 11"):
        load_examples(TrainConfig(dataset=path, prompt_column="q", answer_column="a",
                                  eval_size=11))


def test_without_duplicates_the_held_out_rows_are_the_seeded_draw(tmp_path):
    """Distinct prompts keep the rows the seeded draw over rows chose: splits of such datasets
    (and of the embedded task, distinct by construction) are unchanged."""
    import random

    rows = [{"q": f"p{i}", "a": str(i)} for i in range(30)]
    cfg = TrainConfig(dataset=_jsonl(tmp_path, rows), prompt_column="q", answer_column="a",
                      eval_size=4, seed=7)
    order = list(range(30))
    random.Random(7).shuffle(order)
    _, held_out = load_examples(cfg)
    assert sorted(ex["q"] for ex in held_out) == sorted(f"p{i}" for i in order[:4])


def _save_to_disk(path, splits):
    """A `datasets` save_to_disk directory: one Dataset (splits is a list of rows) or a
    DatasetDict (a dict of split name -> rows)."""
    datasets = pytest.importorskip("datasets")
    if isinstance(splits, dict):
        saved = datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})
    else:
        saved = datasets.Dataset.from_list(splits)
    saved.save_to_disk(str(path))
    return str(path)


def test_a_save_to_disk_directory_is_a_dataset(tmp_path):
    """A directory written by save_to_disk was refused as "no such file"; a DatasetDict's split
    is chosen by --split and --eval_split, as a hub dataset's is."""
    rows = {s: [{"q": f"{s}{i}", "a": f"#### {i}"} for i in range(n)]
            for s, n in (("train", 20), ("test", 5))}
    path = _save_to_disk(tmp_path / "dict", rows)
    validate(resolve_auto(TrainConfig(dataset=path)))  # the CLI's check before any load
    train, held_out = load_examples(TrainConfig(dataset=path, prompt_column="q",
                                                answer_column="a", eval_split="test"))
    assert [ex["q"] for ex in train] == [f"train{i}" for i in range(20)]
    assert [(ex["q"], ex["answer"]) for ex in held_out] == [(f"test{i}", str(i)) for i in range(5)]
    with pytest.raises(UsageError, match="--eval_split 'train' is the training split"):
        load_examples(TrainConfig(dataset=path, prompt_column="q", answer_column="a",
                                  eval_split="train"))  # held-out rows = training rows
    with pytest.raises(UsageError, match=r"has no split 'valid'; its splits are \['test', "
                                         r"'train'\]"):
        load_examples(TrainConfig(dataset=path, prompt_column="q", answer_column="a",
                                  eval_split="valid"))
    one = _save_to_disk(tmp_path / "one", rows["train"])
    train, held_out = load_examples(TrainConfig(dataset=one, prompt_column="q", answer_column="a",
                                                eval_size=2))
    assert (len(train), len(held_out)) == (18, 2)
    with pytest.raises(UsageError, match="--eval_split 'test': .* is one saved Dataset"):
        load_examples(TrainConfig(dataset=one, prompt_column="q", answer_column="a",
                                  eval_split="test"))


def test_a_directory_that_is_no_saved_dataset_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(UsageError, match="is a directory without the dataset_dict.json"):
        validate(resolve_auto(TrainConfig(dataset=str(tmp_path / "d"))))


def test_a_saved_dataset_without_datasets_installed(tmp_path, monkeypatch):
    """Without `datasets` the directory is one clear line, not an ImportError."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(UsageError, match="save_to_disk, and reading it needs `datasets`"):
        read_rows(str(tmp_path / "d"), None, "train")


def test_rows_of_split_picks_a_mapping_split():
    """The split choice itself, on a plain mapping (what a DatasetDict is to it)."""
    loaded = {"train": [{"q": "a"}], "test": [{"q": "b"}]}
    assert data.rows_of_split(loaded, "p", "test") == [{"q": "b"}]
    assert data.rows_of_split([{"q": "c"}], "p", "anything") == [{"q": "c"}]


@pytest.mark.parametrize("argv", [["--task_eval_fraction", "0.99", "--task_terms", "2",
                                   "--task_max_operand", "5"],
                                  ["--task_eval_fraction", "0.9", "--task_terms", "2",
                                   "--task_max_operand", "1"]])
def test_an_embedded_task_held_out_whole_is_an_error(argv):
    """A held-out share that rounds to every problem left an empty training set: the run
    crashed in the format warm-up with "IndexError: Cannot choose from an empty sequence"."""
    from grpo_train import parse_config

    with pytest.raises(UsageError, match="--task_eval_fraction 0.9.* holds out all"):
        load_examples(parse_config(argv))
