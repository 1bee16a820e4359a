"""Prompts and answers: the embedded arithmetic task, dataset loading, and a resumable sampler.

An example is a dict with "prompt" (a string, or a list of chat messages), "answer" (a string;
None when the dataset has no answers) and the dataset's other columns, which reward functions
receive as keyword arguments.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import random

import numpy as np

from .checks import LOCAL_DATASET_FORMATS, check_dataset_source, saved_dataset_layout
from .flags import UsageError
from .hub import check_hub_reachable

# ---- the embedded task --------------------------------------------------------------------------


def arithmetic_task(max_operand: int = 9, eval_fraction: float = 0.25, seed: int = 0,
                    terms: int = 2):
    """Every sum of `terms` digits in [0, max_operand] ("3+0+2+1"), split into (train, held_out).

    The split is over distinct problems, so every held-out problem is one the policy never trains
    on: it has to generalize the addition, not memorize a table. The tiny tokenizer's chat
    template renders the prompt "3+0+2+1" as "3+0+2+1=", and the expected completion is "6" EOS.
    """
    if max_operand < 1 or terms < 2:
        raise UsageError(f"--task_max_operand must be >= 1 and --task_terms >= 2, got "
                         f"{max_operand} and {terms}")
    if not 0 < eval_fraction < 1:
        raise UsageError(f"--task_eval_fraction must be in (0, 1), got {eval_fraction}")
    if (max_operand + 1) ** terms > 200_000:
        raise UsageError("the embedded task would have more than 200,000 problems; lower "
                         "--task_terms or --task_max_operand")
    problems = list(itertools.product(range(max_operand + 1), repeat=terms))
    random.Random(seed).shuffle(problems)
    n_eval = max(1, round(eval_fraction * len(problems)))
    if n_eval >= len(problems):  # nothing left to train on (the warm-up failed on an empty set)
        raise UsageError(f"--task_eval_fraction {eval_fraction} holds out all {len(problems)} "
                         "problems of the embedded task, leaving none to train on; lower it, or "
                         "raise --task_max_operand or --task_terms")

    def example(digits):
        return {"prompt": "+".join(map(str, digits)), "answer": str(sum(digits))}

    held_out = [example(p) for p in problems[:n_eval]]
    train = [example(p) for p in problems[n_eval:]]
    return train, held_out


def random_answer_texts(examples: list[dict], rng: random.Random,
                        fallback: list[str] = ()) -> list[str]:
    """Format warm-up targets: answers drawn at random from the examples' answer set (those
    that have one; `fallback` when none has), independent of the prompt, so supervised training
    on them teaches the output format but not the task."""
    pool = sorted({ex["answer"] for ex in examples if ex["answer"] is not None}) or fallback
    return [rng.choice(pool) for _ in examples]


# ---- answers ------------------------------------------------------------------------------------

def parse_gsm8k_answer(text: str) -> str:
    """GSM8K-style ground truth "reasoning ... #### 1,234" -> "1234" (after the last "####");
    other text stripped."""
    if "####" not in text:
        return text.strip()
    return text.rsplit("####", 1)[1].strip().replace(",", "")


# ---- datasets -----------------------------------------------------------------------------------

_LOCAL_FORMATS = LOCAL_DATASET_FORMATS


def _json_rows(data) -> list:
    """A JSON document's rows: a list of rows, {"data": [rows]}, {"column": [values], ...} or
    one row {"column": value, ...}."""
    if not isinstance(data, dict):
        return list(data)
    if "data" in data and isinstance(data["data"], list):
        return data["data"]
    lengths = {k: len(v) if isinstance(v, list) else type(v).__name__ for k, v in data.items()}
    if not any(isinstance(v, list) for v in data.values()):
        return [data]
    if len(set(lengths.values())) > 1:  # zip would drop the longer columns' tails
        raise ValueError("expected a list of rows, or columns of equal length; got columns of "
                         f"different lengths {lengths}")
    return [dict(zip(data, vals)) for vals in zip(*data.values())]


def _read_local(path: str) -> list[dict]:
    """Rows of a local json/jsonl/csv (stdlib) or parquet (via `datasets`) file. Text is read as
    UTF-8 with or without a byte order mark (which spreadsheet programs write)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        with open(path, newline="", encoding="utf-8-sig") as fh:
            return list(csv.DictReader(fh))
    if ext in (".json", ".jsonl"):
        with open(path, encoding="utf-8-sig") as fh:
            text = fh.read()
        if ext == ".json":
            try:
                return _json_rows(json.loads(text))
            except json.JSONDecodeError:  # JSON lines saved with a .json extension
                pass
        # "\n" only: str.splitlines would also cut at U+2028 and others inside JSON strings
        return [json.loads(line) for line in text.split("\n") if line.strip()]
    import datasets  # parquet; imported only here (the GPU image may not have it)

    return list(datasets.load_dataset("parquet", data_files=path, split="train"))


def _read_hub(name: str, config: str | None, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError as err:
        raise UsageError(
            f"--dataset {name!r} is not a local file, and loading hub datasets needs `datasets` "
            "(pip install 'grpo-kernels[train]')"
        ) from err
    check_hub_reachable("--dataset", name, "a local .json/.jsonl/.csv/.parquet file")
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as err:  # noqa: BLE001 - re-raised with the argument named
        raise UsageError(
            f"--dataset {name!r} (config {config!r}, split {split!r}) could not be loaded: "
            f"{type(err).__name__}: {err}. Expected a local .json/.jsonl/.csv/.parquet file or a "
            "hub dataset id"
        ) from err


def _read_saved(path: str, split: str) -> list[dict]:
    """Rows of a `datasets` save_to_disk directory: a Dataset's rows, or a DatasetDict's
    `split` (as a hub dataset's split is chosen)."""
    try:
        import datasets
    except ImportError as err:
        raise UsageError(
            f"--dataset {path!r} is a directory written by `datasets`' save_to_disk, and reading "
            "it needs `datasets` (pip install 'grpo-kernels[train]')"
        ) from err
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001 - re-raised with the argument named
        raise UsageError(f"--dataset {path!r} could not be read with datasets.load_from_disk: "
                         f"{type(err).__name__}: {err}") from err
    return rows_of_split(loaded, path, split)


def rows_of_split(loaded, path: str, split: str) -> list[dict]:
    """A loaded Dataset's rows, or split `split` of a DatasetDict (a mapping of split names)."""
    if not hasattr(loaded, "keys"):  # a Dataset: one split, checked by _check_local_splits
        return list(loaded)
    if split not in loaded:
        raise UsageError(f"--dataset {path!r} has no split {split!r}; its splits are "
                         f"{sorted(loaded.keys())} (--split, --eval_split)")
    return list(loaded[split])


def read_rows(name: str, config: str | None, split: str) -> list[dict]:
    ext = os.path.splitext(name)[1].lower()
    if os.path.isdir(name) and saved_dataset_layout(name):
        return _read_saved(name, split)
    if os.path.isfile(name):
        if ext not in _LOCAL_FORMATS:
            raise UsageError(f"--dataset {name!r}: unsupported file type {ext!r}; expected one "
                             f"of {sorted(_LOCAL_FORMATS)}")
        try:
            rows = _read_local(name)
        except Exception as err:  # noqa: BLE001 - JSON/CSV/parquet/encoding errors alike
            raise UsageError(f"--dataset {name!r} could not be read as {ext[1:]}: "
                             f"{type(err).__name__}: {err}") from err
        if not all(isinstance(row, dict) for row in rows):
            raise UsageError(f"--dataset {name!r}: expected one object (column: value) per row")
        return rows
    check_dataset_source(name)
    return _read_hub(name, config, split)


def _prompt_problem(prompt, present: bool) -> str | None:
    """What is wrong with a row's prompt (None: text, or a non-empty list of chat messages)."""
    if isinstance(prompt, str):  # a blank CSV cell: no tokens to generate from
        return None if prompt.strip() else f"blank text {prompt!r}"
    if not isinstance(prompt, list):  # a row without the column, null, a number
        return f"{prompt!r}" if present else "no such column"
    if not prompt:
        return "an empty list"
    for i, message in enumerate(prompt, 1):
        if not isinstance(message, dict):
            return f"item {i} is {message!r}"[:200]
        for key in ("role", "content"):
            if key not in message:
                return f"item {i} has no {key!r} (a message is {{'role': ..., 'content': ...}})"
    return None


def to_examples(rows: list[dict], prompt_column: str, answer_column: str | None,
                where: str) -> list[dict]:
    """Rows -> examples; a clear error when the named columns are missing."""
    if not rows:
        raise UsageError(f"{where} has no rows")
    columns = list(dict.fromkeys(key for row in rows for key in row))  # JSON rows may differ
    missing = [(flag, col) for flag, col in (("--prompt_column", prompt_column),
                                             ("--answer_column", answer_column))
               if col and col not in columns]
    if missing:
        named = ", ".join(f"{flag} {col!r}" for flag, col in missing)
        raise UsageError(f"{where} has no column {named}; its columns are {columns}")
    examples = []
    for number, row in enumerate(rows, 1):
        prompt = row.get(prompt_column)
        got = _prompt_problem(prompt, prompt_column in row)
        if got:
            raise UsageError(f"{where} row {number}: --prompt_column {prompt_column!r} must be "
                             f"non-blank text or a list of chat messages, got {got}")
        ex = dict(row)
        ex["prompt"] = prompt
        answer = row.get(answer_column) if answer_column else None
        answer = None if answer is None else parse_gsm8k_answer(str(answer))
        ex["answer"] = answer or None  # blank (an empty CSV cell): no truth, never scored
        examples.append(ex)
    return examples


DEFAULT_EVAL_ROWS = 200  # --eval_size auto with a dataset: at most this many held-out rows


def _check_local_splits(cfg) -> None:
    """A local file, or one saved Dataset, is one split: naming another would read the same rows
    again (held-out rows that are the training rows). A saved DatasetDict has its splits."""
    if os.path.isfile(cfg.dataset):
        kind = "a local file"
    elif os.path.isdir(cfg.dataset) and saved_dataset_layout(cfg.dataset) == "dataset":
        kind = "one saved Dataset (not a DatasetDict)"
    else:
        return
    for flag, value, default in (("--split", cfg.split, "train"),
                                 ("--eval_split", cfg.eval_split, None)):
        if value != default:
            raise UsageError(
                f"{flag} {value!r}: --dataset {cfg.dataset!r} is {kind}, which has no "
                "splits (its rows would be read for every split, the held-out rows being the "
                "training rows). Leave out --split and --eval_split; --eval_size N holds out N "
                "of its prompts")


def load_examples(cfg, say=print) -> tuple[list[dict], list[dict]]:
    """(train, held_out) examples for the configuration: the embedded task or a dataset; `say`
    warns of --eval_split prompts that are training prompts too."""
    if not cfg.dataset:  # held-out problems stay out of training whatever --eval_size says
        train, held_out = arithmetic_task(cfg.task_max_operand, cfg.task_eval_fraction, cfg.seed,
                                          cfg.task_terms)
        return train, held_out if cfg.eval_size is None else held_out[: cfg.eval_size]
    _check_local_splits(cfg)
    if cfg.eval_split == cfg.split:
        raise UsageError(f"--eval_split {cfg.eval_split!r} is the training split (--split): "
                         "the held-out rows would be the training rows. Name another split, or "
                         "leave out --eval_split to hold out --eval_size prompts of it")
    rows = read_rows(cfg.dataset, cfg.dataset_config, cfg.split)
    train = to_examples(rows, cfg.prompt_column, cfg.answer_column, f"--dataset {cfg.dataset!r}")
    if cfg.eval_split:
        eval_rows = read_rows(cfg.dataset, cfg.dataset_config, cfg.eval_split)
        held_out = to_examples(eval_rows, cfg.prompt_column, cfg.answer_column,
                               f"--dataset {cfg.dataset!r} split {cfg.eval_split!r}")
        held_out = held_out[: DEFAULT_EVAL_ROWS if cfg.eval_size is None else cfg.eval_size]
        warning = split_overlap(train, held_out, cfg.split, cfg.eval_split)
        if warning:
            say(warning)
        return train, held_out
    eval_size = cfg.eval_size
    if eval_size is None:  # auto: a tenth of the distinct prompts, at most DEFAULT_EVAL_ROWS
        distinct = len({_prompt_key(ex["prompt"]) for ex in train})
        eval_size = min(DEFAULT_EVAL_ROWS, distinct // 10)
    if eval_size <= 0:
        return train, []
    return hold_out_prompts(train, eval_size, cfg.seed)


def _prompt_key(prompt) -> tuple[str, str]:
    """A hashable key under which copies of one prompt (text or chat messages) are equal; text
    never equals the JSON of messages."""
    if isinstance(prompt, str):
        return "text", prompt
    return "chat", json.dumps(prompt, sort_keys=True, default=str)


def split_overlap(train: list[dict], held_out: list[dict], split: str,
                  eval_split: str) -> str | None:
    """A warning when held-out prompts are training prompts too (a split built from the same
    pool, or duplicated rows): their accuracy is not held out. None when they are disjoint.
    One set of the training prompts' keys: O(rows)."""
    trained = {_prompt_key(ex["prompt"]) for ex in train}
    shared = [_prompt_key(ex["prompt"]) for ex in held_out]
    shared = [key for key in shared if key in trained]
    if not shared:
        return None
    return (f"warning: {len(shared)} of the {len(held_out)} held-out rows of --eval_split "
            f"{eval_split!r} ({len(set(shared))} distinct prompts) have a prompt that --split "
            f"{split!r} trains on: held-out accuracy counts them, and they are not held out")


def hold_out_prompts(examples: list[dict], eval_size: int, seed: int):
    """(train, held_out): `eval_size` distinct prompts, drawn in a seeded order, go to held_out
    with every row that repeats them; no held-out prompt is ever trained on. Without duplicate
    prompts this is `eval_size` rows, the same rows for the same seed as a draw over rows."""
    keys = [_prompt_key(ex["prompt"]) for ex in examples]
    distinct = list(dict.fromkeys(keys))  # first-appearance order, deterministic
    if eval_size >= len(distinct):
        raise UsageError(f"--eval_size {eval_size} leaves no training prompts out of "
                         f"{len(distinct)} distinct prompts ({len(examples)} rows); lower it or "
                         "pass --eval_split")
    order = list(range(len(distinct)))
    random.Random(seed).shuffle(order)
    held = {distinct[i] for i in order[:eval_size]}
    return ([ex for key, ex in zip(keys, examples) if key not in held],
            [ex for key, ex in zip(keys, examples) if key in held])


# ---- sampling -----------------------------------------------------------------------------------


class PromptSampler:
    """Endless epochs over the training examples, each in a seeded random order.

    Its position (epoch, index) is all a checkpoint needs to continue with the same prompts; it
    does not touch the global RNGs, so it is identical on every process.
    """

    def __init__(self, num_examples: int, seed: int):
        if num_examples < 1:
            raise UsageError("the training set is empty")
        self.n, self.seed = num_examples, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.index)
            out.extend(int(i) for i in self._order[self.index:self.index + take])
            self.index += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise UsageError(f"--resume: the checkpoint was written for {state['n']} training "
                             f"examples, this run has {self.n}")
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)
