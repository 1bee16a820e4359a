"""`run_as_forward` with two FSDP2 processes (gloo): roots that reshard after forward (accelerate's
FSDP2, TRL's reference model) give the unsharded model's loss, log-probs and gradients, tied
head, LoRA-wrapped root, gradient accumulation and a bf16 mixed-precision policy included, on
the whole head's three-pass route (fsdp2_worker.py runs the cases)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "parallel"))
from mp_launch import REPO, free_port  # noqa: E402


@pytest.mark.slow
def test_fsdp2_roots_that_reshard_after_forward_match_the_unsharded_model(tmp_path):
    pytest.importorskip("peft")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # the chunked backend: force_backend in the worker
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(HERE / "fsdp2_worker.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["reference"]["logps"] < 1e-5, (rank, got)
        for case in ("tied", "untied_lora"):
            assert got[case]["loss"] < 1e-5, (rank, case, got[case])
            assert got[case]["grad"] < 1e-5, (rank, case, got[case])
            # the registered forward's end resharded the root
            assert got[case]["head_resharded"], (rank, case, got[case])
        # MixedPrecisionPolicy(bf16 parameters, float32 reduction): the fused loss sees the
        # bf16 head, and every gradient is as close to the float32 model's as a plain bf16
        # copy's is (relative to the largest gradient of each parameter)
        mixed = got["mixed_precision"]
        assert mixed["head_dtype"] == ["torch.bfloat16"] and mixed["grad_dtype"] == "torch.float32"
        for name, (err, plain_err) in mixed["errors"].items():
            assert err < 2 * plain_err + 1e-3 and err < 3e-2, (rank, name, err, plain_err)
        # the registered forward hands the fused loss the whole [V, D] head: the whole head's
        # route (three passes for a token-level loss with a gradient), not a vocabulary-parallel
        # one (which a DTensor shard would take)
        loss_routes = [line for line in got["routes"] if "linear-head loss on" in line]
        assert loss_routes and all("three-pass route" in line and "vocabulary-parallel" not in
                                   line for line in loss_routes), got["routes"]
        # the head passed outside the model's forward: refused, naming FSDP2
        error = got["outside_forward"]["error"]
        assert error and "differ" in error and "FSDP2 (fully_shard)" in error, (rank, error)
