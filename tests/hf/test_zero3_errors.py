"""A DeepSpeed ZeRO-3 head passed to the fused functions without being gathered: the error names
the argument and says what to do, on a real partitioned parameter (deepspeed.zero.Init, one
process, gloo; a fresh process, as DeepSpeed keeps global state)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
import deepspeed  # noqa: E402

from grpo_kernels import fused_linear_grpo_loss, selective_logprobs  # noqa: E402

with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3},
                                              "train_batch_size": 1}):
    head = torch.nn.Linear(16, 64, bias=False)  # [V, D] = [64, 16], partitioned
assert head.weight.shape == (0,), head.weight.shape
hidden, ids = torch.randn(2, 3, 16), torch.randint(0, 64, (2, 3))
for call in (lambda: fused_linear_grpo_loss(hidden, head.weight, ids, torch.randn(2)),
             lambda: selective_logprobs(hidden, head.weight, ids)):
    try:
        call()
    except ValueError as err:
        print("ERROR:", err)
dist.destroy_process_group()
sys.stdout.flush()
# DeepSpeed's native threads can abort interpreter teardown ("terminate called without an
# active exception", SIGABRT, intermittently): leave without it, the checks done
import os  # noqa: E402
os._exit(0)
"""


def test_an_ungathered_zero3_head_is_named(tmp_path):
    pytest.importorskip("deepspeed")
    script = tmp_path / "zero3_head.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1",
               DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 2, proc.stdout[-2000:]
    for line in errors:
        assert ("weight is a parameter partitioned by DeepSpeed ZeRO-3 (here (0,), whole "
                "(64, 16)): gather it first (deepspeed.zero.GatheredParameters)") in line, line
