"""grpo_train --resume against what a user can hand it: settings that differ from the
checkpoint's run, a file that is not a checkpoint, an earlier checkpoint while later ones exist,
another run's output directory, and a metrics.jsonl whose last record a crash tore."""

import dataclasses
import json
import shutil

import pytest
import torch

from grpo_train import TrainConfig, train
from grpo_train.flags import UsageError
from grpo_train.logs import MetricsLog, read_metrics

TINY = dict(steps=2, num_prompts=2, num_generations=2, max_new_tokens=2, format_warmup_steps=1,
            tiny_hidden_size=16, task_terms=2, task_max_operand=3, eval_every=0,
            backend="chunked", progress=False, plot=False, save_final_model=False,
            num_threads=1, save_every=1, keep_checkpoints=0)


def tiny_cfg(out, **overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "output_dir": str(out), **overrides})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A two-step run with the checkpoints of steps 1 and 2 (a second or two)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    train(tiny_cfg(out))
    return out


def copy_of(run, tmp_path, name="run"):
    return shutil.copytree(run, tmp_path / name)


def test_settings_that_change_the_run_are_refused(finished_run, tmp_path, capsys):
    """The optimizer and scheduler states would silently keep the checkpoint's learning rate,
    and another seed would split the embedded task differently: both are named, with the
    checkpoint's values, before any model loads. --steps may change, and is said."""
    out = copy_of(finished_run, tmp_path)
    with pytest.raises(UsageError) as err:
        train(tiny_cfg(out, resume="auto", steps=3, learning_rate=1e-5, seed=3))
    message = str(err.value)
    assert "--learning_rate 1e-05 (the checkpoint's: 0.001)" in message
    assert "--seed 3 (the checkpoint's: 0)" in message and "--steps" not in message
    assert "resumed from" not in capsys.readouterr().out
    result = train(tiny_cfg(out, resume="auto", steps=3, save_every=5))
    assert result["step"] == 3
    said = capsys.readouterr().out
    assert "settings changed from the checkpoint's run: --steps 2 -> 3, --save_every 1 -> 5" in said


@pytest.mark.parametrize("content, match", [
    (b"not a checkpoint", "could not be read as a checkpoint"),
    ({"weights": torch.zeros(2)}, "is not a grpo-train checkpoint .it has no step, model"),
])
def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path, content, match):
    path = tmp_path / "step_000001.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(UsageError, match=f"--resume '{path}' {match}"):
        train(tiny_cfg(tmp_path / "run", resume=str(path)))


def test_an_earlier_checkpoint_is_refused_while_later_ones_exist(finished_run, tmp_path):
    """Resuming step 1 beside step 2 mixed two histories: the new step 2 went missing from
    metrics.jsonl when --resume auto later took the old step 2 up again."""
    out = copy_of(finished_run, tmp_path)
    first = out / "checkpoints" / "step_000001.pt"
    with pytest.raises(UsageError, match="later checkpoints of that run .step_000002.pt."):
        train(tiny_cfg(out, resume=str(first)))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_000001.pt", "step_000002.pt"]  # nothing was deleted


def test_a_checkpoint_never_continues_into_another_runs_directory(finished_run, tmp_path):
    other = copy_of(finished_run, tmp_path, "other")
    before = (other / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match="holds another run.s files .checkpoints, initial_model"):
        train(tiny_cfg(other, resume=str(finished_run), steps=3))
    assert (other / "metrics.jsonl").read_text() == before
    # a new directory takes it: the run goes on from step 2 there
    assert train(tiny_cfg(tmp_path / "fork", resume=str(finished_run), steps=3))["step"] == 3


def test_a_torn_last_metrics_record_is_dropped(tmp_path):
    """A crash in mid-write (kill -9, a full disk) leaves half a line at the end of
    metrics.jsonl; the resume (and --resume of a complete run) used to stop on a JSONDecodeError."""
    log = MetricsLog(tmp_path, enabled=True)
    for step in range(3):
        log.write({"step": step, "reward": 0.5})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as fh:
        fh.write('{"step": 3, "rew')
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    MetricsLog(tmp_path, enabled=True, resume_step=2)
    assert path.read_text().endswith("}\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    path.write_text('{"step": 0}\n{"step": 1, "rew\n{"step": 2}\n')  # not torn: damaged
    with pytest.raises(UsageError, match="metrics.jsonl: line 2 is not a JSON record"):
        MetricsLog(tmp_path, enabled=True, resume_step=2)


def test_eval_size_that_splits_the_training_rows_is_refused(tmp_path):
    """With a dataset and no --eval_split, --eval_size decides which rows are trained on: a
    resume with another value failed only after the model had loaded ("the checkpoint was
    written for 33 training examples, this run has 31"), naming no flag. It is refused with the
    other settings now; with the embedded task it only caps the held-out problems and may change."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    out = tmp_path / "run"
    train(tiny_cfg(out, dataset=str(data), eval_size=3, steps=1))
    with pytest.raises(UsageError, match="--eval_size 5 .the checkpoint's: 3."):
        train(tiny_cfg(out, dataset=str(data), eval_size=5, steps=2, resume="auto"))
    embedded = tmp_path / "embedded"
    train(tiny_cfg(embedded, eval_size=3, steps=1))
    assert train(tiny_cfg(embedded, eval_size=5, steps=2, resume="auto"))["step"] == 2


@pytest.mark.parametrize("model", ["", "some/model"])
def test_a_checkpoint_without_the_bias_correction_field_trained_without_it(tmp_path, model):
    """A checkpoint written before --use_bias_correction_kl existed trained with the KL alone;
    with --model the flag's default is now on: resuming must not switch it on silently."""
    from grpo_train.checkpoint import check_resumed_config
    from grpo_train.config import resolve_auto

    cfg = resolve_auto(tiny_cfg(tmp_path, model=model))
    saved = dataclasses.asdict(cfg)
    del saved["use_bias_correction_kl"]
    said = []
    if model:
        with pytest.raises(UsageError, match="--use_bias_correction_kl on .the checkpoint's: off"):
            check_resumed_config({"config": saved}, cfg, tmp_path, said.append)
        cfg = dataclasses.replace(cfg, use_bias_correction_kl=False)
    check_resumed_config({"config": saved}, cfg, tmp_path, said.append)
    assert said == []
