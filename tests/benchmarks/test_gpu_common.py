"""benchmarks/gpu_common.sh's helpers, sourced in a scratch tree as the device scripts do."""

import subprocess
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_common.sh"


def _install_peers(tmp_path, left: int) -> tuple[str, str]:
    """install_peers 60 with `left` seconds before the deadline, with a stand-in installer that
    says how it was called; returns (steps.txt, env.txt)."""
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "peer-1.0-py3-none-any.whl").touch()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "install_wheels.sh").write_text('echo "installer ran"\n')
    out = tmp_path / "out"
    script = (f'source "{COMMON}"; START=$(( $(date +%s) - 100 )); DEADLINE={100 + left}; '
              f"install_peers 60")
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env={"OUT": str(out),
                         "DRY_RUN": "0", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    env = out / "env.txt"
    return (out / "steps.txt").read_text(), env.read_text() if env.exists() else ""


@pytest.mark.parametrize("left", [10, -30])
def test_the_peers_install_is_skipped_past_the_deadline(tmp_path, left):
    """With 20 s or less left (or the deadline passed) the install is a skipped step: it used to
    run under `timeout 0` (no limit at all) or fail on a negative one."""
    steps, env = _install_peers(tmp_path, left)
    assert "skipped install peers: deadline" in steps
    assert "installer ran" not in env


def test_the_peers_install_runs_within_the_time_left(tmp_path):
    steps, env = _install_peers(tmp_path, 45)
    assert "install peers from .whl/" in steps and "installer ran" in env
