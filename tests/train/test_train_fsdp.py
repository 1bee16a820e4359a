"""Sharded training (`grpo_train --fsdp`, FSDP2): two CPU processes (gloo) give the same per-step
loss, KL, entropy and gradient norm as the DDP run with the same seed (float32 rounding apart),
each process really holds only a shard, and a sharded checkpoint resumes exactly."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import json, os, sys
import torch
from grpo_train import sharding
from grpo_train.cli import parse_config
from grpo_train import train
import grpo_train

# the code under test, not an installed copy of another checkout
assert grpo_train.__file__.startswith(os.environ["GRPO_TEST_REPO"]), grpo_train.__file__

result = train(parse_config(sys.argv[1:]))  # what `python -m grpo_train` runs
out, rank = os.environ["GRPO_TEST_DIR"], os.environ["RANK"]
model = result["model"]  # after --fsdp: a plain full model on rank 0, the sharded one elsewhere
if result["main_process"]:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(out, "params.pt"))
else:
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in model.parameters())
    with open(os.path.join(out, f"shard_{rank}.json"), "w") as fh:
        json.dump({"sharded": sharding.is_sharded(model), "local": local,
                   "full": sum(p.numel() for p in model.parameters())}, fh)
"""

ARGS = ["--steps", "3", "--num_prompts", "4", "--num_generations", "4", "--max_new_tokens", "3",
        "--format_warmup_steps", "2", "--tiny_hidden_size", "32", "--task_terms", "2",
        "--task_max_operand", "5", "--num_iterations", "2", "--micro_batch_size", "2",
        "--beta", "0.04", "--eval_every", "3", "--save_every", "2", "--backend", "chunked",
        "--no-progress", "--no-plot", "--num_threads", "1", "--device", "cpu", "--seed", "3"]
COMPARED = ("loss", "kl", "entropy", "grad_norm", "reward", "completion_length")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, out, *extra) -> list[dict]:
    """Two processes via accelerate launch; returns the run's metrics.jsonl records."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    test_dir = tmp_path / f"{out.name}_files"
    test_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(driver),
           "--output_dir", str(out), *ARGS, *extra]
    env = dict(os.environ, GRPO_TEST_DIR=str(test_dir), OMP_NUM_THREADS="1",
               GRPO_TEST_REPO=str(REPO),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _by_step(records):
    return {r["step"]: r for r in records if "loss" in r}


def _assert_same_steps(got, want, steps):
    for step in steps:
        for key in COMPARED:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-7), \
                (step, key, got[step][key], want[step][key])


@pytest.mark.slow
def test_fsdp_matches_ddp_and_resumes_from_its_checkpoint(tmp_path):
    ddp = _by_step(_launch(tmp_path, tmp_path / "ddp"))
    fsdp = _by_step(_launch(tmp_path, tmp_path / "fsdp", "--fsdp"))
    assert sorted(fsdp) == sorted(ddp) == [1, 2, 3]
    _assert_same_steps(fsdp, ddp, [1, 2, 3])
    assert any(abs(ddp[s]["kl"]) > 1e-6 for s in ddp)  # the policy moved: not a vacuous match

    # the other process held a shard of every sharded parameter, not a copy
    shard = json.loads((tmp_path / "fsdp_files" / "shard_1.json").read_text())
    assert shard["sharded"] and shard["local"] < 0.6 * shard["full"]
    # the final models agree (rank 0's plain model gathered from the shards)
    want = torch.load(tmp_path / "ddp_files" / "params.pt")
    got = torch.load(tmp_path / "fsdp_files" / "params.pt")
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    assert (tmp_path / "fsdp" / "final_model" / "config.json").exists()

    # a sharded checkpoint is a DDP one: same keys, optimizer state by parameter index
    load = lambda run: torch.load(tmp_path / run / "checkpoints" / "step_000002.pt",  # noqa: E731
                                  weights_only=False)
    ck_fsdp, ck_ddp = load("fsdp"), load("ddp")
    assert sorted(ck_fsdp["model"]) == sorted(ck_ddp["model"])
    assert sorted(ck_fsdp["optimizer"]["state"]) == sorted(ck_ddp["optimizer"]["state"])
    for i, st in ck_ddp["optimizer"]["state"].items():
        torch.testing.assert_close(ck_fsdp["optimizer"]["state"][i]["exp_avg_sq"],
                                   st["exp_avg_sq"], rtol=1e-4, atol=1e-10)

    # resume the sharded run from step 2: step 3 is the uninterrupted run's step 3
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp", resumed_dir)
    (resumed_dir / "checkpoints" / "step_000003.pt").unlink()
    shutil.rmtree(resumed_dir / "final_model")
    resumed = _by_step(_launch(tmp_path, resumed_dir, "--fsdp", "--resume", "auto"))
    assert sorted(resumed) == [1, 2, 3]
    _assert_same_steps(resumed, fsdp, [3])


def test_fsdp_without_a_process_group_is_a_clear_error():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_train import sharding

    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    with pytest.raises(ValueError, match="--fsdp needs several processes"):
        sharding.shard_model(model, torch.device("cpu"))
    assert not sharding.is_sharded(model)
    # unsharded models take the plain paths
    assert sharding.state_dicts(model, torch.optim.SGD(model.parameters()))[0].keys() == \
        model.state_dict().keys()
    with sharding.full_parameters(model):
        pass


def test_fsdp_refuses_a_unit_of_mixed_dtypes_by_flag():
    """--fp32_lm_head on a bf16 model puts a float32 head beside bf16 embeddings in the root
    unit; FSDP2 would fail inside its first forward. The refusal names the flags, before any
    collective (so no process group is needed to see it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_train import sharding
    from grpo_train.flags import UsageError
    from grpo_train.models import use_fp32_head

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, tie_word_embeddings=False))
    use_fp32_head(model.to(torch.bfloat16))
    with pytest.raises(UsageError, match=r"mix bfloat16 \(model\.embed_tokens\.weight\), "
                                         r"float32 \(lm_head\.weight\).*--fp32_lm_head"):
        sharding.shard_model(model, torch.device("cpu"))
    assert not sharding.is_sharded(model)


def test_fsdp_accumulates_unsynchronized_micro_batches_locally(tmp_path):
    """The trainer's micro-batch backward under --fsdp (one process, gloo): a micro-batch
    without gradient sync reduce-scatters nothing (FSDP2 reads its sync setting during the
    backward, so the backward must run inside `no_sync`); the synchronized one after it gives
    the plain model's accumulated gradients."""
    import contextlib
    import copy
    import types

    import torch.distributed as dist

    from grpo_kernels import FusedLinearGRPOLoss, force_backend
    from grpo_train import sharding, trainer
    from grpo_train.batching import micro_batches
    from grpo_train.tiny import build_tiny_model, build_tokenizer

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        base = build_tiny_model(build_tokenizer(), hidden_size=16, num_layers=1, seed=1)
        model = sharding.shard_model(copy.deepcopy(base), torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(8, 100, (4, 7), generator=g)  # 4 sequences, completions of 3
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "completion_mask": torch.ones(4, 3, dtype=torch.long), "T": 3}
        first, second = micro_batches(batch, "padded", 2, 0)
        adv = torch.randn(4, generator=g)
        runs = [types.SimpleNamespace(cfg=types.SimpleNamespace(loss="fused", num_iterations=1),
                                      ddp_model=m, autocast=contextlib.nullcontext(),
                                      loss_fn=FusedLinearGRPOLoss(), head={}, B=4)
                for m in (base, model)]
        with force_backend("chunked"):
            for run, sync in zip(runs, (True, False)):  # the plain model has nothing to sync
                trainer._backward(run, first, sync, adv[first.seqs], None, None, None, {})
            assert all(p.grad is None for p in model.parameters())  # nothing reduced yet
            for run in runs:
                trainer._backward(run, second, True, adv[second.seqs], None, None, None, {})
        for (name, p), q in zip(base.named_parameters(), model.parameters()):
            torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"grad of {n}: {m}")
    finally:
        dist.destroy_process_group()
