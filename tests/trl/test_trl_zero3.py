"""grpo_kernels.trl.GRPOTrainer under DeepSpeed ZeRO-3 against TRL's own trainer under ZeRO-3.

Two CPU processes (DeepSpeed's CPU accelerator, gloo) launched by `accelerate launch` with a
ZeRO-3 DeepSpeed config (the model loaded under deepspeed.zero.Init, no persistent parameters:
the lm_head weight is an empty shard outside a forward). Three optimizer steps of TRL's trainer
and of ours from the same seed, float32: the logged loss, grad_norm and every metric agree, and
so do all parameters afterwards. Ours must have run its fused path (`hf/zero3.py` gathers the
head and hands the full-weight gradient to DeepSpeed's gradient hook) on every loss and scoring
call: no fallback to TRL's code, no warning. Tied (lm_head.weight is the embedding) and untied
heads.

DeepSpeed is not a test dependency: without it the test is skipped. Ran with DeepSpeed 0.19.8,
accelerate 1.15.0, transformers 5.24.0, TRL 1.16.0, torch 2.13.0+cpu (about 40 s per case on 2
cores; DeepSpeed JIT-builds its CPU communication op with the system C++ compiler on first use).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed); "
                    "the ZeRO-3 run needs it")
import torch  # noqa: E402

from grpo_train.tiny import save_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

DS_CONFIG = {
    "zero_optimization": {
        "stage": 3,
        # every parameter sharded outside its module's forward, however small (default: 1e5
        # elements stay whole), so the tiny head is really a shard
        "stage3_param_persistence_threshold": 0,
    },
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}

ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds_config}
  zero3_init_flag: true
machine_rank: 0
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
"""

DRIVER = """
import functools, json, os, sys, warnings
import torch, deepspeed, trl
from datasets import Dataset
from transformers import PrinterCallback
from trl import GRPOConfig
from grpo_train.tiny import build_tokenizer

which, model_dir, out = sys.argv[1:4]
cfg = json.loads(sys.argv[4])
calls = {"trl_loss": 0, "trl_scoring": 0, "head_backward": 0}
if which == "ours":
    from grpo_kernels.hf import zero3
    from grpo_kernels.trl import GRPOTrainer as cls

    # TRL's own methods are reached from ours only on a fallback
    base = trl.trainer.grpo_trainer.GRPOTrainer
    def counting(name, key):
        original = getattr(base, name)
        @functools.wraps(original)  # grpo_kernels.trl.compat checks TRL's signatures
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        setattr(base, name, wrapper)
    counting("_compute_loss", "trl_loss")
    counting("_get_per_token_logps_and_entropies", "trl_scoring")
    backward = zero3._FullCopy.backward
    def head_backward(ctx, *grads):
        assert grads[0].dim() == 2 and grads[0].numel() > 0, grads[0].shape  # the full [V, D]
        calls["head_backward"] += 1
        return backward(ctx, *grads)
    zero3._FullCopy.backward = staticmethod(head_backward)
else:
    cls = trl.GRPOTrainer

eos = build_tokenizer().eos_token_id
dataset = Dataset.from_dict(
    {"prompt": [[{"role": "user", "content": f"{i}+{2 * i}"}] for i in range(16)]})

def digits_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c[0]["content"]) + 0.1 * len(c[0]["content"])
            for c in completions]

# use_cpu=False: with use_cpu=True transformers/accelerate set up plain multi-CPU DDP instead of
# DeepSpeed; ddp_backend="gloo": without it accelerate (1.x) counts a one-process world under
# DeepSpeed on a machine without an accelerator (the DeepSpeed engine still sees two)
args = GRPOConfig(
    output_dir=out, report_to=[], use_cpu=False, ddp_backend="gloo", bf16=False, seed=0,
    per_device_train_batch_size=4, num_generations=4, max_completion_length=7,
    gradient_accumulation_steps=2, generation_batch_size=16, logging_steps=1, max_steps=3,
    save_strategy="no", disable_tqdm=True, optim="sgd", learning_rate=0.1,
    generation_kwargs={"sequence_bias": [[[eos], 3.5]]}, **cfg)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = cls(model=model_dir, reward_funcs=digits_reward, args=args, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)
    head = trainer.model.get_output_embeddings().weight
    shard = {"numel": head.numel(), "ds_numel": head.ds_numel,
             "local": head.ds_tensor.numel()}
    trainer.train()
ours_warnings = [str(w.message) for w in caught if "grpo_kernels" in str(w.message)]
acc = trainer.accelerator
params = {}
for name, p in trainer.model.named_parameters():
    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        params[name] = p.detach().clone()
result = {"logs": [h for h in trainer.state.log_history if "loss" in h], "calls": calls,
          "warnings": ours_warnings, "shard": shard, "world": acc.num_processes,
          "distributed_type": str(acc.distributed_type), "params": params}
torch.save(result, os.path.join(out, f"result_{acc.process_index}.pt"))
acc.wait_for_everyone()
torch.distributed.destroy_process_group()  # DeepSpeed's CPU backend aborts at exit otherwise
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, which: str, model_dir: str, cfg: dict, ds: dict) -> list[dict]:
    """One 2-process ZeRO-3 training run with DeepSpeed config `ds`; the result of each rank."""
    ds_config = tmp_path / "ds_zero3.json"
    ds_config.write_text(json.dumps(ds))
    acc_config = tmp_path / "accelerate_zero3.yaml"
    acc_config.write_text(ACCELERATE_CONFIG.format(ds_config=ds_config))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    out = tmp_path / f"out_{which}"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc_config),
           "--main_process_port", str(_free_port()), str(driver), which, model_dir, str(out),
           json.dumps(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: the chunked PyTorch path on CPU
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [torch.load(out / f"result_{rank}.pt") for rank in range(2)]
    shutil.rmtree(out)
    return results


# (model, GRPOConfig fields, zero_optimization fields over DS_CONFIG's)
CASES = {
    "tied-dapo-kl": (dict(tie_word_embeddings=True), dict(loss_type="dapo", beta=0.04), {}),
    "untied-grpo-entropy": (dict(tie_word_embeddings=False),
                            dict(loss_type="grpo", entropy_coef=0.05), {}),
    # DeepSpeed's default persistence threshold: the tiny head stays whole after the first step
    "untied-bnpo-persistent": (dict(tie_word_embeddings=False), dict(loss_type="bnpo"),
                               dict(stage3_param_persistence_threshold=100_000)),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_kwargs,cfg,zero", CASES.values(), ids=CASES.keys())
def test_zero3_training_run_matches_trl(tmp_path, model_kwargs, cfg, zero):
    model_dir = str(tmp_path / "model")
    save_tiny_model(model_dir, hidden_size=32, num_layers=2, **model_kwargs)
    ds = {**DS_CONFIG, "zero_optimization": {**DS_CONFIG["zero_optimization"], **zero}}
    ref, ours = (_launch(tmp_path, "trl", model_dir, cfg, ds),
                 _launch(tmp_path, "ours", model_dir, cfg, ds))
    for rank, (r, o) in enumerate(zip(ref, ours)):
        assert r["distributed_type"] == o["distributed_type"] == "DistributedType.DEEPSPEED"
        assert r["world"] == o["world"] == 2
        # outside a forward the head is an empty shard; each process holds half of it
        assert o["shard"]["numel"] == 0 and 2 * o["shard"]["local"] >= o["shard"]["ds_numel"]
        # our fused path ran: never TRL's loss or scoring code, a gathered-head backward on
        # every micro-batch (3 steps x 2 accumulation steps), no fallback warning
        assert o["calls"]["trl_loss"] == 0 and o["calls"]["trl_scoring"] == 0, (rank, o["calls"])
        assert o["calls"]["head_backward"] == 6, (rank, o["calls"])
        assert o["warnings"] == [], o["warnings"]
    want_logs, got_logs = ref[0]["logs"], ours[0]["logs"]
    assert len(want_logs) == len(got_logs) == 3
    assert want_logs[0]["completions/min_length"] < want_logs[0]["completions/max_length"]
    for want, got in zip(want_logs, got_logs):
        assert got.keys() == want.keys()
        for key in want:
            if key != "step_time":
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, want["step"])
    assert want_logs[0]["grad_norm"] > 0
    moved = 0.0
    init = {}
    from transformers import AutoModelForCausalLM

    for name, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters():
        init[name] = p.detach()
    for name, p in ref[0]["params"].items():
        q = ours[0]["params"][name]
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, (p - init[name]).abs().max().item())
        # both ranks hold the same (gathered) parameters
        torch.testing.assert_close(ours[1]["params"][name], q, rtol=0, atol=0)
    assert moved > 1e-3  # training did change the parameters
