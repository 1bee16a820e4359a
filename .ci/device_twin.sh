#!/usr/bin/env bash
# The device twin: every GPU script's dry run (DRY_RUN=1) in a virtual environment made like the
# lent GPU machine's image, in a copy of the tree without .git, each called as the device plan
# calls it. Run by hand before a device call (docs/gpu.md, "Rehearsing on the device's versions"):
# 7 to 13 minutes on 2 cores (and 95 s to make the venv), too long for .ci/run.
#   bash .ci/device_twin.sh [OUT]         (OUT default /tmp/device-twin-out)
#   PY=/root/.pyenv/versions/3.12.1/bin/python VENV=/tmp/venv-device-twin bash .ci/device_twin.sh
#   (PY: a Python 3.12, default python3.12; VENV: made once, then reused)
# The venv has no system site packages: Python 3.12, torch 2.11.0 (PyPI's CUDA build, ~5 GB with
# its nvidia-* packages; it runs on a CPU), the Triton it pins (3.6.0), transformers 5.17.0 and
# what else the image was read to hold (IMAGE below); TRL, datasets, Liger-Kernel, Cut
# Cross-Entropy and pytest-benchmark come from .whl/ (benchmarks/fetch_wheels.sh), as there.
# The dry runs install them into a scratch folder, so the venv stays the image's. Exits 1 when a
# script fails or a step's output says so (an "exit N" other than 0, a trainer row that is not
# ok, a step cut by the deadline, the static generation path falling back, a row whose commit
# is not this checkout's).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3.12}"
VENV="${VENV:-/tmp/venv-device-twin}"
OUT="${1:-/tmp/device-twin-out}"
IMAGE=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 accelerate==1.15.0 peft pytest
       hypothesis pandas pyarrow psutil fsspec xxhash python-dateutil six)
ABSENT=(trl datasets liger_kernel cut_cross_entropy pytest_benchmark)  # not on the image

if ! ls .whl/*.whl > /dev/null 2>&1; then
  echo "device_twin: no wheels in .whl/ (LEAN=1 bash benchmarks/fetch_wheels.sh)" >&2
  exit 2
fi
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ] && ! "$PY" -m venv "$VENV"; then
  echo "device_twin: PY=$PY cannot make a venv: set PY to a Python 3.12 interpreter" >&2
  exit 2
fi
have=$("$VENV/bin/python" -c "import torch, triton, transformers; print(
  torch.__version__.split('+')[0], triton.__version__, transformers.__version__)" 2> /dev/null)
if [ "$have" != "2.11.0 3.6.0 5.17.0" ]; then
  # PyPI, not the CI machine's pip configuration (which caps torch at its local wheels)
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q "${IMAGE[@]}" || exit 2
fi
for module in "${ABSENT[@]}"; do
  if "$VENV/bin/python" -c "import $module" 2> /dev/null; then
    echo "device_twin: $module is installed in $VENV, the image has none: remove it" >&2
    exit 2
  fi
done
echo "device_twin: venv ready ($(( $(date +%s) - t0 ))s): Python $("$VENV/bin/python" -c "import \
sys, torch, triton, transformers as t; print(sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'transformers', t.__version__)")"

# the device's copy: tracked and untracked files git does not ignore, and .whl/; no .git
commit=$(git rev-parse --short HEAD)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$tree"
cp -r .whl "$tree/"
rm -rf "$OUT" && mkdir -p "$OUT"

failed=0
dry() {  # dry NAME VAR=VALUE... SCRIPT: one dry run, timed, its output in $OUT/NAME.stdout
  local name=$1 t rc
  shift
  t=$(date +%s)
  (cd "$tree" && env -u PYTHONPATH -u TRITON_INTERPRET PATH="$VENV/bin:$PATH" DRY_RUN=1 \
    BENCH_COMMIT="$commit" "${@:1:$#-1}" bash "${@: -1}") > "$OUT/$name.stdout" 2>&1
  rc=$?
  echo "device_twin: $name: exit $rc, $(( $(date +%s) - t ))s"
  [ "$rc" = 0 ] || failed=1
}
dry peers OUT="$OUT/peers" PACK=peers benchmarks/gpu_peers.sh
dry session OUT="$OUT/session" PACK=session benchmarks/gpu_session.sh
for part in generation loss steps; do
  dry "trainer-$part" PARTS="$part" DEADLINE_S=300 OUT="$OUT/trainer" benchmarks/gpu_trainer.sh
done
for pack in peers session; do
  tar -xzf "$OUT/$pack/$pack.tgz" -C "$OUT/$pack" || failed=1
done

"$VENV/bin/python" - "$OUT" "$commit" << 'EOF' || failed=1
import csv
import os
import sys
from pathlib import Path

out, commit = Path(sys.argv[1]), sys.argv[2]
bad = []
for path in sorted(out.rglob("*")):
    if path.suffix not in (".txt", ".log") or path.name.endswith("-steps.txt"):
        continue  # (NAME-steps.txt: PACK's copy of steps.txt)
    lines = path.read_text(errors="replace").splitlines()
    if lines and lines[-1].startswith("exit ") and lines[-1] != "exit 0":
        bad.append(f"{path.relative_to(out)}: {lines[-1]}")
    if path.name == "steps.txt" and not any(ln.endswith("] done") for ln in lines):
        bad.append(f"{path.relative_to(out)}: no 'done'")
    bad += [f"{path.relative_to(out)}: {ln}" for ln in lines
            if ("skipped" in ln and "deadline" in ln) or "static cache failed" in ln]
for row in csv.DictReader((out / "trainer" / "gpu_trainer.csv").open()):
    if row["status"] != "ok":
        bad.append(f"gpu_trainer.csv: {row['step']}: {row['status']}")
rows = 0
for path in sorted(out.rglob("results/*.csv")):
    for row in csv.DictReader(path.open()):
        rows += 1
        if row.get("commit") != commit:
            bad.append(f"{path.name}: commit {row.get('commit')!r}, not {commit}")
        if not row.get("device", row.get("machine")):
            bad.append(f"{path.name}: a row without its device")
if any("deadline" in b for b in bad):  # the dry runs' deadlines assume a machine not loaded
    bad.append(f"load average {os.getloadavg()}")
print(f"device_twin: {rows} result rows checked; " + ("; ".join(bad[:20]) or "no failure found"))
sys.exit(1 if bad else 0)
EOF
echo "device_twin: $(( $(date +%s) - t0 ))s in all; files under $OUT"
exit "$failed"
