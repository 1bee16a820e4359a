"""Inputs that ran on silently or failed deep inside a library: prompt + completion past the
model's positions, held-out prompts that are training prompts, and flag values that torch or
transformers reject (or accept and compute garbage with). The command-line cases run in fresh
processes (tests/train/test_cli.py's `run`)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_cli import TINY_RUN, one_line_error, run

from grpo_train.checks import thread_limit, usable_cores
from grpo_train.cli import parse_config
from grpo_train.config import TrainConfig, grpo_params, resolve_auto
from grpo_train.data import load_examples, read_rows, to_examples
from grpo_train.flags import UsageError
from grpo_train.models import render_prompts
from grpo_train.positions import check_positions, position_limit
from grpo_train.run_state import set_threads
from grpo_train.tiny import build_tiny_model, build_tokenizer


def _gpt2_dir(path, positions: int = 16) -> str:
    """A tiny GPT-2 (a learned table of `positions` positions) with the character tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=positions, n_embd=16, n_layer=1,
                        n_head=2, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                        pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---- positions -----------------------------------------------------------------------------


def last_line_error(proc) -> str:
    """A user error after a model loaded: status 2, no traceback, the error the last line of
    stderr (transformers' weight-loading bar may come before it)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("grpo-train: error: "), line
    return line


def test_a_learned_position_table_refuses_prompts_that_cannot_fit(tmp_path):
    """GPT-2 with 16 positions, prompts "a+b=" of 4 tokens: --max_new_tokens 13 failed in the
    forward with `IndexError: index out of range in self` once a completion ran to the cap; now
    one line at start naming the flags and the limit, and nothing written. 12 fits and trains."""
    model = _gpt2_dir(tmp_path / "gpt2")
    out = tmp_path / "run"
    args = [*TINY_RUN, "--model", model]  # 2 x 2 sequences: the automatic 8 takes 4
    line = last_line_error(run([*args, "--max_new_tokens", "13", "--output_dir", str(out)]))
    assert "with --max_new_tokens 13 can reach past the model's 16 positions" in line
    assert "a learned table of 16 positions" in line
    assert "lower --max_new_tokens to 12 or less, or pass --max_prompt_length 3" in line
    assert not out.exists() or not any(out.iterdir())
    fits = run([*args, "--max_new_tokens", "12", "--min_new_tokens", "12",
                "--output_dir", str(tmp_path / "fits")])
    assert fits.returncode == 0, fits.stderr[-2000:]


def test_every_prompt_past_rotary_positions_is_an_error(tmp_path):
    """The embedded Qwen2 model has 256 positions: --max_new_tokens 300 trained on positions up
    to 303 without a word (rotary positions never fail). Every prompt passing the limit is an
    error before the warm-up writes initial_model."""
    out = tmp_path / "run"
    line = one_line_error(run([*TINY_RUN, "--max_new_tokens", "300", "--output_dir", str(out)]))
    assert "16 of 16 prompts" in line and "past the model's 256 positions" in line
    assert "(every prompt)" in line and "rotary positions" in line
    assert "lower --max_new_tokens to 252 or less" in line
    assert not (out / "initial_model").exists()


def test_some_prompts_past_rotary_positions_is_a_warning():
    """Prompts of varying length, only some of which can pass the limit: one warning line
    with the counts; --max_prompt_length that fits silences it; a learned table refuses."""
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, max_position_embeddings=64)
    examples = [{"prompt": "1+1"}, {"prompt": "1+2"}, {"prompt": "9" * 40}]  # 4, 4, 41 tokens
    said = []
    cfg = resolve_auto(TrainConfig(max_new_tokens=30))
    assert position_limit(model) == (64, "rotary")
    check_positions(model, tok, cfg, examples, said.append, render_prompts)
    assert len(said) == 1 and said[0].startswith("warning: 1 of 3 prompts")
    assert "(training and held-out, 4-41 tokens)" in said[0]
    assert "lower --max_new_tokens to 23 or less, or pass --max_prompt_length 34" in said[0]
    said.clear()
    check_positions(model, tok, resolve_auto(TrainConfig(max_new_tokens=30,
                                                         max_prompt_length=34)),
                    examples, said.append, render_prompts)
    check_positions(model, tok, resolve_auto(TrainConfig(max_new_tokens=23)), examples,
                    said.append, render_prompts)
    assert said == []


def test_a_learned_table_refuses_even_one_long_prompt(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _gpt2_dir(tmp_path / "gpt2", positions=32)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    examples = [{"prompt": "1+1"}, {"prompt": "9" * 40}]
    with pytest.raises(UsageError, match="1 of 2 prompts .* a learned table of 32 positions.*"
                                         "pass --max_prompt_length 30"):
        check_positions(model, tok, resolve_auto(TrainConfig(model=path, max_new_tokens=2)),
                        examples, print, render_prompts)


# ---- held-out prompts that are training prompts ------------------------------------------


def test_eval_split_prompts_in_the_training_split_are_reported(tmp_path):
    """A DatasetDict whose test split repeats 3 training prompts (one of them twice) ran with no
    word, and its held-out accuracy counted them."""
    datasets = pytest.importorskip("datasets")
    train = [{"q": f"p{i}", "a": str(i)} for i in range(20)]
    test = [{"q": q, "a": "0"} for q in ("p1", "p2", "p2", "p7", "new0", "new1")]
    path = str(tmp_path / "dict")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(path)
    said = []
    cfg = TrainConfig(dataset=path, prompt_column="q", answer_column="a", eval_split="test")
    load_examples(cfg, said.append)
    assert said == ["warning: 4 of the 6 held-out rows of --eval_split 'test' (3 distinct "
                    "prompts) have a prompt that --split 'train' trains on: held-out accuracy "
                    "counts them, and they are not held out"]
    said.clear()
    load_examples(TrainConfig(dataset=path, prompt_column="q", answer_column="a",
                              eval_split="test", eval_size=1), said.append)  # "p1" only
    assert len(said) == 1 and said[0].startswith("warning: 1 of the 1 held-out rows")
    disjoint = str(tmp_path / "disjoint")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test[4:])}).save_to_disk(disjoint)
    said.clear()
    load_examples(TrainConfig(dataset=disjoint, prompt_column="q", answer_column="a",
                              eval_split="test"), said.append)
    assert said == []


# ---- prompts ------------------------------------------------------------------------------------


def test_a_blank_prompt_is_an_error_naming_the_row(tmp_path):
    """A blank CSV cell was the prompt "": without a chat template it has no tokens, and
    `generate` failed with `IndexError: index -1 is out of bounds for dimension 1 with size 0`."""
    path = tmp_path / "d.csv"
    path.write_text("question,answer\n1+1,2\n,3\n")
    with pytest.raises(UsageError, match="--dataset x row 2: --prompt_column 'question' must be "
                                         "non-blank text .*got blank text ''"):
        to_examples(read_rows(str(path), None, "train"), "question", "answer", "--dataset x")


def test_a_chat_template_that_refuses_the_messages_is_named():
    """A template without a system role raised jinja2's TemplateError from inside transformers
    for --system_prompt (Gemma's and older Mistral templates do)."""
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}")
    assert render_prompts(tok, [{"prompt": "1+1"}], None) == ["1+1="]
    with pytest.raises(UsageError, match=r"chat template refused a prompt of the messages "
                                         r"\(system, user\): System role not supported\. "
                                         "--system_prompt adds a system message"):
        render_prompts(tok, [{"prompt": "1+1"}], "Answer with a number.")


# ---- flag values ------------------------------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    # transformers' sampling: `probability tensor contains either inf, nan or element < 0`
    (["--temperature", "1e-45"], "--temperature must be >= 0.0001, got 1e-45"),
    (["--temperature", "3e-5"], "--temperature must be >= 0.0001, got 3e-05"),
    # logits / 1e300 were 0 in float32: uniform sampling and zero gradients, without a word
    (["--temperature", "1e300"], "--temperature must be <= 10000 (the valid range is "
                                 "[0.0001, 10000]), got 1e+300"),
    (["--temperature", "1.5e4"], "--temperature must be <= 10000"),
    # NaN passed every bound: top_p and max_grad_norm ran on; learning rates crashed in AdamW
    (["--top_p", "nan"], "--top_p must be a finite number, got nan"),
    (["--max_grad_norm", "nan"], "--max_grad_norm must be a finite number"),
    (["--learning_rate", "inf"], "--learning_rate must be a finite number"),  # NaN weights
    (["--format_warmup_lr", "nan"], "--format_warmup_lr must be a finite number"),
    (["--tiny_init_std", "inf"], "--tiny_init_std must be a finite number"),
    (["--lora_alpha", "nan"], "--lora_alpha must be a finite number"),
    (["--weight_decay", "nan"], "--weight_decay must be a finite number"),
    # torch.optim.AdamW's ValueError tracebacks
    (["--adam_beta1", "1.5"], "--adam_beta1 must be in [0, 1), got 1.5"),
    (["--adam_beta2", "-0.1"], "--adam_beta2 must be in [0, 1), got -0.1"),
    (["--format_warmup_lr", "-1"], "--format_warmup_lr must be >= 0"),
    # NumPy's "expected non-negative integer", torch's "Overflow when unpacking long long"
    (["--seed", "-1"], "--seed must be a whole number in [0, 2**63 - 1], got -1"),
    (["--seed", str(2**64)], "--seed must be a whole number in [0, 2**63 - 1]"),
    # torch's AdamW on float16 weights: eps 1e-8 is 0 there, the first step wrote inf and NaN
    (["--model_dtype", "float16"], "--model_dtype float16 would train float16 weights with "
     "AdamW, whose eps (1e-8) is 0 in float16"),
    (["--model_dtype", "float16", "--lora_r", "2"], "the format warm-up (--format_warmup_steps "
     "30) trains every float16 weight"),
    # data flags without a --dataset: the embedded task ran instead
    (["--eval_split", "test"], "--eval_split 'test' applies to a --dataset, and none is given"),
    (["--dataset_config", "main"], "--dataset_config 'main' applies to a --dataset"),
    (["--prompt_column", "problem"], "--prompt_column 'problem' applies to a --dataset"),
])
def test_bad_values_are_refused_when_parsed(args, named):
    with pytest.raises(UsageError) as err:
        parse_config(args)
    assert named in str(err.value)


def test_values_at_the_bounds_parse():
    assert parse_config(["--temperature", "1e-4"]).temperature == 1e-4
    assert parse_config(["--temperature", "7"]).temperature == 7.0
    assert parse_config(["--temperature", "1e4"]).temperature == 1e4
    assert parse_config(["--seed", str(2**63 - 1)]).seed == 2**63 - 1
    # float16 weights with float32 LoRA adapters train (no warm-up of the float16 weights)
    parse_config(["--model_dtype", "float16", "--lora_r", "2", "--format_warmup_steps", "0"])


def test_num_threads_past_what_the_system_runs(tmp_path):
    """--num_threads 100000 (above ulimit -u, 96365, on the machine it was found on) was taken,
    and the first matmul crashed the process (a segmentation fault; 2**31 - 1: libgomp aborts,
    out of memory). It is refused when parsed; above the CPU cores, one warning line."""
    limit, named = thread_limit()  # Linux always has kernel.threads-max
    with pytest.raises(UsageError, match=rf"--num_threads {limit + 1} exceeds this system's "
                                         rf"limit of {limit} {re.escape(named)}"):
        parse_config(["--num_threads", str(limit + 1)])
    with pytest.raises(UsageError, match="--num_threads 2147483648: torch cannot set it"):
        set_threads(2**31)  # what validate let through where the limit is unknown
    before = torch.get_num_threads()
    try:
        assert set_threads(0) is None and set_threads(1) is None
        note = set_threads(usable_cores() + 1)
    finally:
        torch.set_num_threads(before)
    assert note.startswith(f"warning: --num_threads {usable_cores() + 1} is more than the "
                           f"{usable_cores()} CPU cores")


def test_bad_values_in_a_config_file_are_refused(tmp_path):
    """A config file sets fields as flags do, and is checked the same way."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"temperature": 1e-45}))
    with pytest.raises(UsageError, match="--temperature must be >= 0.0001"):
        parse_config(["--config", str(path)])


# ---- the output directory and the backend ----------------------------------------------------


def test_overwrite_keeps_the_previous_run_until_the_new_one_passes_its_checks(tmp_path):
    """--overwrite deleted the previous run as the processes started: a new run refused a moment
    later (a batch that does not divide, prompts past the model's positions) left neither run,
    and `--model OUTPUT_DIR/final_model` deleted the model it was about to load."""
    out = tmp_path / "run"
    args = [a for a in TINY_RUN if a != "--no_save_final_model"]
    assert run([*args, "--output_dir", str(out)]).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    assert "final_model" in before
    cases = [(["--model", str(out / "final_model")], "--overwrite would delete --model"),
             (["--micro_batch_size", "3"], "--micro_batch_size 3 must divide"),
             (["--max_new_tokens", "300"], "past the model's 256 positions")]
    for extra, named in cases:
        proc = run([*args, "--output_dir", str(out), "--overwrite", *extra])
        assert named in one_line_error(proc), extra
        assert sorted(p.name for p in out.iterdir()) == before, extra
        assert (out / "final_model" / "config.json").is_file(), extra
    again = run([*args, "--output_dir", str(out), "--overwrite"])
    assert again.returncode == 0 and "--overwrite: deleted the previous run's" in again.stdout


def test_reward_weights_that_are_all_zero_are_an_error(tmp_path):
    """`--reward accuracy:0` trained with every advantage 0: a run that learned nothing, with
    no word. A zero weight beside another function's (a reward logged, not trained on) runs."""
    line = one_line_error(run([*TINY_RUN, "--reward", "accuracy:0", "format:0",
                               "--output_dir", str(tmp_path / "run")]))
    assert "--reward accuracy:0 format:0: every weight is 0" in line
    assert not (tmp_path / "run" / "initial_model").exists()
    ok = run([*TINY_RUN, "--reward", "accuracy", "format:0", "--output_dir",
              str(tmp_path / "ok")])
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_an_output_dir_that_cannot_be_created_is_named(tmp_path):
    """A path under a file failed with an OSError traceback when the first file was written,
    after the model had been built."""
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "run"
    line = one_line_error(run([*TINY_RUN, "--output_dir", str(target)]))
    assert f"--output_dir '{target}' cannot be created" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton backend runs on this GPU")
def test_triton_backend_on_a_cpu_without_the_interpreter(tmp_path):
    """The first loss call raised a RuntimeError traceback from grpo_kernels, after the model
    had been built and had generated."""
    proc = run([*TINY_RUN, "--backend", "triton", "--output_dir", str(tmp_path / "run")],
               env={"TRITON_INTERPRET": "0"})
    line = one_line_error(proc)
    assert "--backend triton needs a CUDA device, and this run is on cpu" in line
    assert not (tmp_path / "run" / "initial_model").exists()


@pytest.mark.parametrize("argv, expected", [
    ([], False), (["--use_bias_correction_kl"], True), (["--model", "m"], True),
    (["--model", "m", "--no_use_bias_correction_kl"], False)])
def test_bias_correction_flag_reaches_the_loss(argv, expected):
    """The KL's importance-ratio correction: on with --model, as TRL's GRPOConfig default, off
    for the embedded run (config.AUTO), and either way by the flag, in the loss' GRPOParams."""
    assert grpo_params(resolve_auto(parse_config(argv))).use_bias_correction_kl is expected
