"""grpo_train units: configuration, data loading, the prompt sampler, checkpoints, metrics."""

import json
import os
import random

import numpy as np
import pytest
import torch

from grpo_train import logs
from grpo_train.batching import batch_sizes
from grpo_train.checkpoint import (
    capture_rng,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from grpo_train.checks import grad_filter_value
from grpo_train.cli import field_docs, parse_config
from grpo_train.config import AUTO, AUTO_AT_SETUP, TrainConfig, resolve_auto
from grpo_train.data import (
    PromptSampler,
    arithmetic_task,
    load_examples,
    parse_gsm8k_answer,
    read_rows,
    to_examples,
)
from grpo_train.flags import UsageError
from grpo_train.logs import MetricsLog, format_line, plot_curves, read_metrics
from grpo_train.models import completion_mask, position_ids

# ---- configuration ----------------------------------------------------------------------------


def test_defaults_are_the_embedded_run_and_trl_for_a_model():
    embedded = parse_config([])
    pretrained = parse_config(["--model", "some/model"])
    for name, (tiny, real) in AUTO.items():
        if name in AUTO_AT_SETUP:  # a cap, resolved once the processes are known
            assert getattr(embedded, name) is None and getattr(pretrained, name) is None
            continue
        assert getattr(embedded, name) == tiny
        assert getattr(pretrained, name) == real
    assert pretrained.beta == 0.0 and pretrained.num_iterations == 1  # TRL's defaults
    assert embedded.loss_type == "dapo" and embedded.epsilon_low == 0.2


def test_flags_override_config_file(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("steps: 7\nlearning_rate: 0.01\nreward: [accuracy, 'format:0.5']\n"
                         "bf16: true\n")
    cfg = parse_config(["--config", str(yaml_file), "--steps", "3", "--no-bf16"])
    assert (cfg.steps, cfg.learning_rate, cfg.bf16) == (3, 0.01, False)
    assert cfg.reward == ["accuracy", "format:0.5"]
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps({"num_generations": 4, "epsilon_high": 0.28}))
    cfg = parse_config(["--config", str(json_file), "--gradient-checkpointing", "--beta", "0.0"])
    assert cfg.num_generations == 4 and cfg.epsilon_high == 0.28
    assert cfg.gradient_checkpointing is True and cfg.beta == 0.0
    assert parse_config(["--epsilon_high", "none"]).epsilon_high is None


def test_config_errors_name_the_setting(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stepz": 3}))
    with pytest.raises(ValueError, match="stepz"):
        parse_config(["--config", str(bad)])
    with pytest.raises(FileNotFoundError, match="--config"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValueError, match="--num_generations must be >= 2"):
        parse_config(["--num_generations", "1"])
    # EOS suppressed past the cap: every completion ran unended, silently
    with pytest.raises(ValueError, match="--min_new_tokens 5 exceeds --max_new_tokens 3"):
        parse_config(["--min_new_tokens", "5", "--max_new_tokens", "3"])
    assert parse_config(["--min_new_tokens", "3", "--max_new_tokens", "3"]).min_new_tokens == 3
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse_config(["--loss_type", "ppo"])
    with pytest.raises(ValueError, match="--grad_filter must be"):
        parse_config(["--grad_filter", "fast"])
    with pytest.raises(ValueError, match="--grad_filter must be"):
        parse_config(["--grad_filter=-1e-3"])


def test_grad_filter_flag_reaches_the_loss():
    assert parse_config([]).grad_filter is None
    assert grad_filter_value(parse_config(["--grad_filter", "auto"]).grad_filter) == "auto"
    assert grad_filter_value(parse_config(["--grad_filter", "1e-4"]).grad_filter) == 1e-4


def test_automatic_micro_batch_size_divides_the_per_process_batch():
    """With --model the automatic 8 refused every per-process batch it did not divide (3 prompts
    x 4 = 12: "--micro_batch_size 8 must divide"); it is now the largest divisor up to 8, said in
    one line when below 8. A value given that does not divide stays an error."""
    lines = []
    sizes = dict(num_prompts=6, num_generations=4)  # 2 processes: 3 x 4 = 12 sequences each
    assert batch_sizes(parse_config(["--model", "m", "--num_prompts", "6", "--num_generations",
                                     "4"]), 2, lines.append) == (3, 12, 6)
    assert len(lines) == 1 and "micro-batches: 6 sequences each" in lines[0]
    assert "3 x 4 = 12" in lines[0] and "automatic 8" in lines[0]
    cases = [(dict(num_prompts=3, num_generations=7), 1, 7), (dict(num_prompts=4), 1, 8),
             (dict(num_prompts=1, num_generations=5), 1, 5), (dict(), 1, 8)]
    for extra, world, micro in cases:
        cfg = resolve_auto(TrainConfig(model="m", **extra))
        assert batch_sizes(cfg, world)[2] == micro, extra
    assert batch_sizes(resolve_auto(TrainConfig(**sizes)), 2) == (3, 12, 12)  # embedded: all
    with pytest.raises(UsageError, match="--micro_batch_size 8 must divide .* 3 x 4 = 12"):
        batch_sizes(resolve_auto(TrainConfig(model="m", micro_batch_size=8, **sizes)), 2)


def test_resolve_auto_keeps_explicit_values():
    cfg = resolve_auto(TrainConfig(learning_rate=0.5, beta=0.0))
    assert cfg.learning_rate == 0.5 and cfg.beta == 0.0 and cfg.num_iterations == 4



# ---- data ------------------------------------------------------------------------------------


def test_arithmetic_task_split_is_disjoint_and_correct():
    train, held_out = arithmetic_task(max_operand=3, eval_fraction=0.25, seed=0, terms=4)
    assert len(train) + len(held_out) == 4 ** 4 and len(held_out) == 64
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in held_out}
    for ex in train + held_out:
        assert ex["answer"] == str(sum(int(d) for d in ex["prompt"].split("+")))
    assert arithmetic_task(3, 0.25, 0, 4) == (train, held_out)  # deterministic
    assert arithmetic_task(3, 0.25, 1, 4)[1] != held_out


def test_gsm8k_answers():
    assert parse_gsm8k_answer("She has 3 + 4 = 7.\n#### 1,234") == "1234"
    assert parse_gsm8k_answer(" 42 ") == "42"


@pytest.mark.parametrize("ext", ["jsonl", "json", "csv"])
def test_local_files_and_missing_columns(tmp_path, ext):
    rows = [{"question": "1+1", "answer": "so #### 2", "id": "a"},
            {"question": "2+2", "answer": "#### 4", "id": "b"}]
    path = tmp_path / f"data.{ext}"
    if ext == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif ext == "json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("question,answer,id\n" + "".join(
            f"{r['question']},{r['answer']},{r['id']}\n" for r in rows))
    examples = to_examples(read_rows(str(path), None, "train"), "question", "answer", "x")
    assert [e["answer"] for e in examples] == ["2", "4"]
    assert examples[0]["prompt"] == "1+1" and examples[1]["id"] == "b"
    with pytest.raises(ValueError, match="--prompt_column 'problem'") as info:
        to_examples(read_rows(str(path), None, "train"), "problem", "answer", "--dataset x")
    assert "question" in str(info.value)  # the error lists the columns there are


@pytest.mark.parametrize("second, got", [({"prompt": "2+2"}, "got no such column"),
                                         ({"question": None}, "got None"),
                                         ({"question": 7}, "got 7")])
def test_a_row_without_a_usable_prompt_is_named(tmp_path, second, got):
    """Only the first row's columns were checked: a later row without the prompt column was a
    KeyError, and a null prompt trained on as text."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"question": "1+1"}, second]))
    with pytest.raises(UsageError, match=f"--dataset x row 2: --prompt_column 'question' must "
                                         f"be non-blank text or a list of chat messages, {got}"):
        to_examples(read_rows(str(path), None, "train"), "question", "", "--dataset x")


def test_dataset_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--dataset"):
        read_rows(str(tmp_path / "nope.jsonl"), None, "train")
    weird = tmp_path / "data.xml"
    weird.write_text("<x/>")
    with pytest.raises(ValueError, match="unsupported file type"):
        read_rows(str(weird), None, "train")


def test_held_out_rows_come_out_of_training(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": f"p{i}", "a": str(i)}) + "\n" for i in range(10)))
    cfg = TrainConfig(dataset=str(path), prompt_column="q", answer_column="a", eval_size=3)
    train, held_out = load_examples(cfg)
    assert len(train) == 7 and len(held_out) == 3
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in held_out}


def test_eval_size_auto_follows_the_data(tmp_path):
    """--eval_size auto: the embedded task's held-out problems; 10% of a dataset's rows, at most
    200, none below 10 rows (an --eval_split: test_train_data.py). A number caps or holds out."""
    assert parse_config([]).eval_size is None and parse_config(["--eval_size", "auto"]) == \
        parse_config([])
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("eval_size: auto\n")
    assert parse_config(["--config", str(yaml_file)]).eval_size is None
    train, held_out = load_examples(TrainConfig())
    assert (len(train), len(held_out)) == (182, 61)  # 3^5 problems, a quarter held out
    capped_train, capped = load_examples(TrainConfig(eval_size=10))
    assert capped == held_out[:10] and capped_train == train  # never trained on either way
    assert load_examples(TrainConfig(eval_size=0))[1] == []

    def rows(n, name):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"q": f"p{i}", "a": str(i)}) + "\n" for i in range(n)))
        return str(path)

    for n, held in [(5, 0), (20, 2), (2500, 200)]:
        cfg = TrainConfig(dataset=rows(n, f"d{n}.jsonl"), prompt_column="q", answer_column="a")
        train, held_out = load_examples(cfg)
        assert (len(train), len(held_out)) == (n - held, held), n


def test_sampler_resumes_exactly():
    a = PromptSampler(7, seed=3)
    first = a.next(5)
    state = a.state_dict()
    rest = [a.next(4) for _ in range(4)]
    b = PromptSampler(7, seed=3)
    b.load_state_dict(state)
    assert [b.next(4) for _ in range(4)] == rest
    assert sorted(first + rest[0][:2]) == list(range(7))  # each epoch is a permutation
    with pytest.raises(ValueError, match="training examples"):
        PromptSampler(8, seed=3).load_state_dict(state)


# ---- sequences -------------------------------------------------------------------------------


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 1, 0, 0], [5, 1, 1, 7, 0], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(completion_mask(ids, [1]), expected)


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


# ---- checkpoints -----------------------------------------------------------------------------


def test_checkpoints_are_atomic_and_pruned(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step_000002.pt", "step_000003.pt"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]

    def failing_save(obj, fh):  # a crash while writing: the old checkpoints must survive
        fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, {"step": 4}, keep=1)
    monkeypatch.undo()
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert files == ["step_000002.pt", "step_000003.pt"]
    assert load_checkpoint(find_checkpoint("auto", tmp_path))["step"] == 3


def test_find_checkpoint_variants(tmp_path):
    assert find_checkpoint(None, tmp_path) is None
    assert find_checkpoint("auto", tmp_path) is None  # nothing yet: start fresh
    with pytest.raises(FileNotFoundError, match="--resume"):
        find_checkpoint("last", tmp_path)
    with pytest.raises(FileNotFoundError, match="--resume"):
        find_checkpoint(str(tmp_path / "nope.pt"), tmp_path)
    path = save_checkpoint(tmp_path, 5, {"step": 5})
    assert find_checkpoint("auto", tmp_path) == path
    assert find_checkpoint(str(tmp_path), "elsewhere") == path
    assert find_checkpoint(str(path), "elsewhere") == path


def test_rng_states_round_trip():
    state = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_log_truncates_on_resume_and_plots(tmp_path):
    log = MetricsLog(tmp_path, enabled=True)
    for step in range(4):
        log.write({"step": step, "reward": step / 4, "accuracy": step / 4,
                   "completion_length": 2.0})
    MetricsLog(tmp_path, enabled=True, resume_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    line = format_line({"step": 3, "reward": 0.5, "reward_std": 0.1, "accuracy": 0.5,
                        "entropy": 1.0, "completion_length": 2.0, "loss": 0.1,
                        "grad_norm": 1.0, "tokens_per_s": 1e4, "peak_memory_gib": 0.5,
                        "kl": 0.01, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.1,
                        "clip_ratio/region_mean": 0.1})
    for part in ("step 3", "reward 0.500±0.100", "acc 0.500", "kl 0.0100", "clip 0.000/0.100",
                 "ent 1.000", "len 2.0", "loss 0.1000", "gnorm 1.000", "10,000 tok/s",
                 "mem 0.50GiB"):
        assert part in line
    assert "kernel_fallbacks" not in line  # a healthy step's line: as it always was
    assert format_line({"step": 3, "kernel_fallbacks": 0}) == format_line({"step": 3})
    fell_back = format_line({"step": 3, "kernel_fallbacks": 12})
    assert fell_back == format_line({"step": 3}) + " | kernel_fallbacks 12"
    pytest.importorskip("matplotlib")
    assert "curves written" in plot_curves(tmp_path)
    assert os.path.getsize(tmp_path / "curves.png") > 1000


def test_step_record_counts_the_steps_kernel_fallbacks(monkeypatch):
    """The record has kernel_fallbacks (the step's calls on the chunked path, summed over
    processes) only when some call of the step fell back."""
    from types import SimpleNamespace

    accel = SimpleNamespace(reduce=lambda t, op: t, num_processes=1)
    run = SimpleNamespace(accel=accel, cfg=SimpleNamespace(num_prompts=1, num_generations=2),
                          device=torch.device("cpu"), acc_col=None, world=1, tp=1,
                          scheduler=SimpleNamespace(get_last_lr=lambda: [1e-3]))
    batch = {"lengths": torch.tensor([3, 4]), "truncated": torch.tensor([False, True]),
             "prompt_tokens": torch.tensor(5)}
    rewards = torch.tensor([1.0, 0.0])
    calls = iter([4, 4, 4, 9])  # so far in the process: at each step's start, then its end

    def record():
        monkeypatch.setattr(logs, "kernel_fallbacks", lambda: next(calls))
        start = logs.step_start()
        return logs.step_metrics(run, 1, batch, rewards[:, None], rewards, {"_tokens": 7.0},
                                 0.5, [1.0], start)

    assert "kernel_fallbacks" not in record()
    assert record()["kernel_fallbacks"] == 5


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    message = plot_curves(tmp_path)
    assert "pip install" in message and "matplotlib" in message
    assert not (tmp_path / "curves.png").exists()


def test_parquet_files_load_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"question": "3+4", "answer": "#### 7"}]).to_parquet(str(path))
    examples = to_examples(read_rows(str(path), None, "train"), "question", "answer", "x")
    assert examples == [{"question": "3+4", "answer": "7", "prompt": "3+4"}]


def test_config_file_values_are_typed_like_flags(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("steps: '7'\nlearning_rate: 1\nbf16: 'yes'\nreward: format\nbeta: null\n")
    cfg = parse_config(["--config", str(good)])
    assert (cfg.steps, cfg.learning_rate, cfg.bf16, cfg.reward) == (7, 1.0, True, ["format"])
    for text, field in (("steps: 2.5\n", "steps must be int"), ("bf16: 3\n", "bf16 must be bool"),
                        ("model: null\n", "model must be str"), ("steps: [\n", "could not")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(UsageError, match=f"--config '{bad}'.*{field}"):
            parse_config(["--config", str(bad)])


def test_help_text_comes_from_the_field_metadata():
    docs, topics = field_docs()
    names = [name for _, fields in topics for name in fields]
    assert sorted(names) == sorted(TrainConfig.__dataclass_fields__)  # every field, once
    assert docs["num_generations"] == "G: completions per prompt (a group); must be >= 2"
    assert docs["model"].startswith("Local directory or hub id of any AutoModelForCausalLM")
    assert all(docs[name] for name in names), [n for n in names if not docs[n]]


def test_hf_argument_parser_reads_train_config():
    """TrainConfig is declared as TRL's configs are, so transformers' HfArgumentParser builds a
    parser from it (under its own conventions): this breaks if a field's metadata gains a key
    argparse does not take, or a help text a bare % (argparse formats help with %)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(TrainConfig)
    args = ["--num_generations", "4", "--no_lora_head", "--reward", "accuracy", "format:0.2"]
    (cfg,) = parser.parse_args_into_dataclasses(args, look_for_args_file=False)
    assert cfg == TrainConfig(num_generations=4, lora_head=False,
                              reward=["accuracy", "format:0.2"])
    text = " ".join(parser.format_help().split())
    assert "G: completions per prompt (a group); must be >= 2" in text
    assert "min(200, 10% of the dataset's distinct prompts)" in text
