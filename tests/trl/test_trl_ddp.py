"""grpo_kernels.trl.GRPOTrainer against TRL 1.16's trainer in two CPU processes (DDP over gloo,
`torch.distributed.run`), with the options whose numbers are reduced across processes: the
top_entropy_quantile threshold over every process's real tokens, the per-sequence clip metrics
(clip_ratio/low_min, high_max) gathered from both, the adaptive entropy controller's window
mean, and the off-policy mask and KL metrics. Three optimizer steps from the same seed: the
logged numbers agree, and so do the parameters on both ranks."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
import torch  # noqa: E402

from grpo_train.tiny import save_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import json, os, sys, warnings
import torch, trl
from datasets import Dataset
from transformers import PrinterCallback
from trl import GRPOConfig
from grpo_train.tiny import build_tokenizer

which, model_dir, out = sys.argv[1:4]
cfg = json.loads(sys.argv[4])
if which == "ours":
    from grpo_kernels.trl import GRPOTrainer as cls
else:
    cls = trl.GRPOTrainer
eos = build_tokenizer().eos_token_id
dataset = Dataset.from_dict(
    {"prompt": [[{"role": "user", "content": f"{i}+{2 * i}"}] for i in range(16)]})

def digits_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c[0]["content"]) + 0.1 * len(c[0]["content"])
            for c in completions]

args = GRPOConfig(
    output_dir=out, report_to=[], use_cpu=True, bf16=False, seed=0,
    per_device_train_batch_size=4, num_generations=4, max_completion_length=7,
    gradient_accumulation_steps=2, generation_batch_size=16, logging_steps=1, max_steps=3,
    save_strategy="no", disable_tqdm=True, optim="sgd", learning_rate=0.1,
    generation_kwargs={"sequence_bias": [[[eos], 3.5]]}, **cfg)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = cls(model=model_dir, reward_funcs=digits_reward, args=args, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
acc = trainer.accelerator
result = {"logs": [h for h in trainer.state.log_history if "loss" in h],
          "world": acc.num_processes,
          "warnings": [str(w.message) for w in caught if "grpo_kernels" in str(w.message)],
          "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}
torch.save(result, os.path.join(out, f"result_{acc.process_index}.pt"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, which: str, model_dir: str, cfg: dict) -> list[dict]:
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    out = tmp_path / f"out_{which}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_free_port()), str(driver), which, model_dir, str(out),
           json.dumps(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: the chunked PyTorch path on CPU
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"result_{rank}.pt") for rank in range(2)]


@pytest.mark.slow
def test_two_processes_with_reduced_options_match_trl(tmp_path):
    model_dir = str(tmp_path / "model")
    save_tiny_model(model_dir, hidden_size=32, num_layers=2)
    # the entropy target above the entropy: the adaptive coefficient engages after step 1
    cfg = dict(loss_type="grpo", importance_sampling_level="sequence", top_entropy_quantile=0.4,
               use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=50.0,
               off_policy_mask_threshold=0.01, beta=0.04, num_iterations=2,
               mask_truncated_completions=True)
    ref, ours = _launch(tmp_path, "trl", model_dir, cfg), _launch(tmp_path, "ours", model_dir,
                                                                 cfg)
    assert ref[0]["world"] == ours[0]["world"] == 2
    assert ours[0]["warnings"] == [] and ours[1]["warnings"] == []
    want_logs, got_logs = ref[0]["logs"], ours[0]["logs"]
    assert len(want_logs) == len(got_logs) == 3
    assert "clip_ratio/low_min" in want_logs[0] and "entropy_coef" in want_logs[0]
    for want, got in zip(want_logs, got_logs):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key != "step_time":
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, want["step"])
    for rank in range(2):
        for name, p in ref[rank]["params"].items():
            torch.testing.assert_close(ours[rank]["params"][name], p, rtol=0, atol=1e-5,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
