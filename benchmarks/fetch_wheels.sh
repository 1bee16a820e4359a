#!/usr/bin/env bash
# Downloads, on a machine with network access, the wheels the GPU benchmark installs on a device
# machine that has none: the peers of the kernel sweep (TRL, Cut Cross-Entropy, Liger-Kernel)
# and the packages `import trl.trainer.utils` needs (TRL's head imports it in its backward)
# that an image with torch, Triton and transformers may lack. Each is fetched with --no-deps, for
# the device's Python and platform (not this machine's); benchmarks/install_wheels.sh installs
# from them there, adding only what is missing.
#
# Usage (repository root): bash benchmarks/fetch_wheels.sh [DEST]    (default DEST: .whl)
#   PY=3.12 PLATFORM=x86_64 bash benchmarks/fetch_wheels.sh
# Then carry .whl to the device machine (it is git-ignored).
#
# Versions: the peers as the benchmark pins them; the rest are versions that ran TRL 1.16's head
# on CPU (torch 2.13, transformers 5.24), except pyarrow: 24.0.0, the oldest datasets 5.2 admits,
# has the smallest wheel (47 MiB of the 62 MiB in all; a device call carries at most 64 MiB).
# LEAN=1 leaves out pandas and pyarrow, for an image known to have them (4 MiB in all then). Packages torch and
# transformers bring with them (numpy, huggingface_hub, safetensors, pyyaml, packaging, filelock,
# tqdm, jinja2) are not fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
PY="${PY:-3.12}"
PLATFORM="${PLATFORM:-x86_64}"
mkdir -p "$DEST"

PEERS=(trl==1.16.0 cut-cross-entropy==25.1.1 liger-kernel==0.8.5)
# trl -> accelerate, datasets, pandas, pyarrow, psutil; datasets -> dill, multiprocess, xxhash,
# fsspec; pandas -> python-dateutil -> six.
DEPS=(accelerate==1.15.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
      fsspec==2026.9.0 python-dateutil==2.9.0.post0 six==1.17.0 psutil==7.2.2)
# gpu_session.sh's benchmark suite needs pytest-benchmark (-> py-cpuinfo; 5.2 fails on pytest 9.2)
DEPS+=(pytest-benchmark==5.3.1 py-cpuinfo==9.0.0)
[ "${LEAN:-0}" = 1 ] || DEPS+=(pandas==3.1.1 pyarrow==24.0.0)

# Binary wheels must match the device's interpreter: ask for that ABI and the manylinux tags a
# current x86_64 image accepts.
target=(--only-binary=:all: --implementation cp --python-version "$PY"
        --platform "manylinux_2_28_$PLATFORM" --platform "manylinux_2_17_$PLATFORM"
        --platform "manylinux2014_$PLATFORM" --platform any)
for spec in "${PEERS[@]}" "${DEPS[@]}"; do
  echo "== $spec"
  python -m pip download -q --no-deps "${target[@]}" -d "$DEST" "$spec"
done
ls -l "$DEST"
du -sh "$DEST"
