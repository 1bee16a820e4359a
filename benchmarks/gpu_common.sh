# Sourced by the GPU scripts (gpu_session.sh, gpu_peers.sh) from the repository root: the output
# folder $OUT (default ./gpu_out, with results/), the start time, `stamp MESSAGE` (a timed line
# on stdout and in $OUT/steps.txt) and `write_env`, which writes $OUT/env.txt: nvidia-smi,
# Python, torch, CUDA, Triton, the device and the commit (BENCH_COMMIT when the tree copy has
# no .git).
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/steps.txt"; }
write_env() {
  {
    nvidia-smi || true
    python -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__,
      'cuda', torch.version.cuda, 'triton', triton.__version__,
      'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    echo "commit ${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  } > "$OUT/env.txt" 2>&1
}
