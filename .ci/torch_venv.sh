#!/usr/bin/env bash
# Make a virtual environment with one torch release next to the main environment's test tools:
#   bash .ci/torch_venv.sh 2.15.0 [DIR]    -> prints DIR (default /tmp/venv-torch-2.15.0)
# --system-site-packages reuses the main environment's NumPy, pytest, hypothesis, transformers
# and TRL; only torch, the Triton it pins (when that differs from the main environment's) and
# its nvidia-* runtime packages go into the venv, so the venv's python imports that release.
# The CI machine's pip configuration (/etc/xdg/pip) caps torch at the newest release on its own
# disk; PIP_CONFIG_FILE=/dev/null makes pip read no configuration file, so a newer release comes
# from PyPI (PyPI's CUDA build, ~3 GB with its nvidia-* packages, which runs on a CPU too).
set -euo pipefail
version="$1"
dir="${2:-/tmp/venv-torch-$version}"
if [ ! -x "$dir/bin/python" ]; then
  python -m venv --system-site-packages "$dir"
fi
have=$("$dir/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null \
  || true)
if [ "$have" != "$version" ]; then
  PIP_CONFIG_FILE=/dev/null "$dir/bin/python" -m pip install -q "torch==$version" >&2
fi
"$dir/bin/python" -c "import torch, sys; v = torch.__version__.split('+')[0]; \
assert v == sys.argv[1], v" "$version"
echo "$dir"
