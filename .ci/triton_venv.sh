#!/usr/bin/env bash
# Make a virtual environment with one Triton release next to the installed torch and project:
#   bash .ci/triton_venv.sh 3.4.0 [DIR]    -> prints DIR (default /tmp/venv-triton-3.4.0)
# --system-site-packages reuses the main environment's torch and test tools; only triton is
# installed into the venv (one ~150-300 MB wheel), so the venv's python imports that release.
set -euo pipefail
version="$1"
dir="${2:-/tmp/venv-triton-$version}"
if [ ! -x "$dir/bin/python" ]; then
  python -m venv --system-site-packages "$dir"
fi
have=$("$dir/bin/python" -c "import triton; print(triton.__version__)" 2>/dev/null || true)
if [ "$have" != "$version" ]; then
  "$dir/bin/python" -m pip install -q "triton==$version" >&2
fi
"$dir/bin/python" -c "import triton, sys; assert triton.__version__ == sys.argv[1], \
  triton.__version__" "$version"
echo "$dir"
