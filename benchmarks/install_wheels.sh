#!/usr/bin/env bash
# Installs the kernel sweep's peers (TRL, Cut Cross-Entropy, Liger-Kernel) from the wheels in
# .whl/ (benchmarks/fetch_wheels.sh) on a machine without network access, and pytest-benchmark
# where it is missing, then prints what is importable. Used by gpu_session.sh, gpu_peers.sh and
# gpu_trainer.sh (through gpu_common.sh's install_peers); without .whl/ it only reports.
#
# pip first resolves the peers against what is installed plus .whl/ (--no-index), so only missing
# or too-old packages come from .whl/ and nothing already there is replaced. If that resolution
# fails (a pin the image does not meet and .whl/ does not hold), every wheel whose distribution
# is not installed yet is installed with --no-deps; the import check below then says what works.
#
# TARGET=DIR installs into DIR instead of the environment (pip --target; the caller puts DIR on
# PYTHONPATH): only the distributions not installed yet, each with --no-deps, and a wheel built
# for another Python is reported and left out. The dry runs of the GPU scripts use it, so that
# a rehearsal never changes the machine's environment.
set -uo pipefail
WHL="${WHL:-.whl}"
TARGET="${TARGET:-}"
PEERS=(trl==1.16.0 cut-cross-entropy==25.1.1 liger-kernel==0.8.5)
TOOLS=(pytest-benchmark)  # gpu_session.sh's benchmark suite; installed only where missing

installed() {  # installed DIST: is this distribution installed (in TARGET too)?
  PYTHONPATH="${TARGET:+$TARGET:}${PYTHONPATH:-}" python -c \
    "import sys, importlib.metadata as m; m.version(sys.argv[1])" "$1" 2> /dev/null
}
missing_one_by_one() {  # each wheel whose distribution is not installed, with --no-deps
  local whl dist
  for whl in "$WHL"/*.whl; do
    dist=$(basename "$whl" | cut -d- -f1)  # a wheel's name starts with its distribution
    if ! installed "$dist"; then
      python -m pip install -q --no-index --no-deps ${TARGET:+--target "$TARGET"} "$whl" \
        || echo "install_wheels: $whl failed"
    fi
  done
}

if ! ls "$WHL"/*.whl > /dev/null 2>&1; then
  echo "install_wheels: no wheels in $WHL/ (benchmarks/fetch_wheels.sh downloads them)"
elif [ -n "$TARGET" ]; then
  mkdir -p "$TARGET"
  echo "install_wheels: into $TARGET (pip --target), missing distributions only"
  missing_one_by_one
else
  if ! python -m pip install -q --no-index --find-links "$WHL" "${PEERS[@]}"; then
    echo "install_wheels: resolution failed; installing missing distributions with --no-deps"
    missing_one_by_one
  fi
  for tool in "${TOOLS[@]}"; do  # a tool whose wheel .whl/ lacks stays missing (said below)
    if ! installed "$tool"; then
      python -m pip install -q --no-index --find-links "$WHL" "$tool" \
        || echo "install_wheels: $tool not installed"
    fi
  done
fi

# What each provider needs: trl's head imports trl.trainer.utils in its backward.
PYTHONPATH="${TARGET:+$TARGET:}${PYTHONPATH:-}" python - << 'EOF'
import importlib
import importlib.metadata as m

for dist, module in (("trl", "trl.trainer.utils"), ("cut-cross-entropy", "cut_cross_entropy"),
                     ("liger-kernel", "liger_kernel.chunked_loss"),
                     ("pytest-benchmark", "pytest_benchmark")):
    try:
        importlib.import_module(module)
        print(f"{dist} {m.version(dist)}: import {module} ok")
    except Exception as exc:  # any failure here only means that provider's rows read n/a
        print(f"{dist}: import {module} failed: {type(exc).__name__}: {exc}")
EOF
