"""Running a worker script under torchrun for the multi-process CPU tests (gloo): every rank
with one thread, faulthandler on (a rank that aborts prints its threads' stacks), the
repository on the path, and a timeout, so that a hang fails the test instead of blocking CI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, nproc: int, *args: str, timeout: int = 420,
             interpreter: bool = True) -> None:
    """Run `script args...` on `nproc` processes; assert that every one exited with 0.
    interpreter=False runs without Triton's interpreter (TRITON_INTERPRET unset)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("GRPO_KERNELS_THREE_PASS", None)
    if not interpreter:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def leave_after_barrier() -> None:
    """A worker's last call, once its results are written: every rank past the barrier (its
    last collective), then the process leaves without running destructors. gloo sends
    asynchronously, and tearing it down while a peer's last send is in flight, or its threads
    at interpreter exit, aborted ranks under load ("terminate called without an active
    exception") after their results were written."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
