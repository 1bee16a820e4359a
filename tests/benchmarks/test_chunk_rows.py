"""benchmarks/chunk_rows.py at a tiny head: each rows value runs in its own process and takes
the route it asks for (0: the four-pass route; R: three passes in chunks of R rows; default)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_rows_value_takes_its_route():
    out = subprocess.run([sys.executable, "-m", "benchmarks.chunk_rows", "--shapes", "tiny:64",
                          "--rows", "0,16,default", "--rounds", "1", "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["rows"]: r for r in map(json.loads, (ln for ln in out.stdout.splitlines()
                                                   if ln.startswith("{")))}
    assert set(rows) == {"0", "16", "default"}
    assert any("four-pass" in ln and "GRPO_KERNELS_THREE_PASS=0" in ln for ln in rows["0"]["route"])
    for r in ("16", "default"):
        assert any("three-pass" in ln for ln in rows[r]["route"]), rows[r]["route"]
        assert rows[r]["wall_s"] > 0 and rows[r]["tokens"] > 0
    assert "tiny N=64 rows 16:" in out.stdout and "CPU / four-pass" in out.stdout
