#!/usr/bin/env bash
# One call on a machine with a CUDA device (H100/H200): GPU tests, the benchmark sweeps, the plots
# and the static report. Designed to finish inside a 10-minute command limit: every step has its
# own `timeout` (their sum is 590 s), cut to what is left of a 570 s deadline, and the sweeps
# stop starting new (provider, shape) pairs when their --time-budget runs out. Rows are appended
# as they are measured, so a step cut short still leaves its numbers.
# benchmarks/gpu_peers.sh is the shorter call that races the fused linear loss (both routes)
# against the peers.
#
# The device run, step by step (seconds: timeout):
#   1. environment; the peers from .whl/ (60)
#   2. pytest: the gpu tests and the API matrices on the device, Triton backend (140)
#   3. the pytest-benchmark suite's gpu cases (40)
#   4. targets: N = 16384, Qwen2.5-0.5B and Llama-3-8B heads, every provider and mode (160)
#   5. scaling: fwd+bwd, N = 4096..65536, three heads, eager providers (100)
#   6. plots (2 × 20); 7. the static report for this GPU's architecture (50)
#
# On a GPU machine that gets a copy of the tree (repository root here; the peers' wheels fetched
# once, 4 MiB):
#   LEAN=1 bash benchmarks/fetch_wheels.sh
#   BENCH_COMMIT=<sha> OUT=$OUT PACK=session bash benchmarks/gpu_session.sh   (.whl/ copied along)
#   with <sha> = `git rev-parse --short HEAD` here, written into the command (the device's copy
#   of the tree has no .git); the files come back as $OUT/session.tgz and $OUT/session-steps.txt
# Elsewhere: BENCH_COMMIT=<short sha> OUT=/some/dir bash benchmarks/gpu_session.sh
# BENCH_COMMIT names the commit in every CSV row when the tree copy has no .git. The peers (TRL,
# Cut Cross-Entropy, Liger-Kernel) are not on the device image: without .whl/ their rows read
# "n/a: ... not installed".
#
# The dry run: DRY_RUN=1 OUT=/some/dir bash benchmarks/gpu_session.sh runs every step on the CPU
# (the tests' small selection in Triton's interpreter, the CPU cases of the benchmark suite, the
# sweeps at the synthetic heads, the static report of three sm_90 variants) in about two minutes
# and writes the same files (tests/benchmarks/test_gpu_dry_run.py).
#
# Writes under $OUT (with PACK=NAME: in $OUT/NAME.tgz, and the steps in $OUT/NAME-steps.txt):
#   env.txt, steps.txt       nvidia-smi, versions, commit; each step, timed
#   pytest_gpu.txt           the gpu tests and the API matrices on the device (Triton backend)
#   bench_suite.txt/.json    pytest benchmarks/ --benchmark-only -m gpu
#   targets.md               table: N=16384, qwen0.5b + llama8b heads, all providers and modes
#   scaling.md               table: fwd+bwd, N = 4096..65536, three heads
#   results/<device>.csv     every row of both sweeps (copy into benchmarks/results/)
#   bench_fwd_bwd.png        time and memory vs N (fwd+bwd), bench_forward.png
#   static-smN.md            compile_check --report for this GPU's architecture (the static
#                            model next to the measured rows above)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_common.sh

device_block() {
  DEADLINE=570  # seconds from the start: each step's timeout is cut to what is left
  INSTALL_TIMEOUT=60
  # the API matrices launch the Triton backend on the GPU (tests/helpers.py: KERNEL_DEVICE); on
  # an H100 with 8 workers they took 92 s
  PYTEST_SELECT=(-k "triton or gpu")
  PYTEST_WORKERS=8
  PYTEST_TIMEOUT=140
  SUITE_SELECT=(-m gpu)
  SUITE_TIMEOUT=40
  SWEEP_ARGS=()
  # the targets (N=16384, Qwen2.5-0.5B and Llama-3-8B heads, bf16), all providers and modes;
  # torch.compile of the reference is last inside each shape (its compile time is what most
  # often runs a budget out)
  TARGETS=(--quick --modes forward,backward,fwd+bwd)
  TARGETS_TIME=(120 160)  # (--time-budget, timeout) in seconds
  # scaling in N (memory must stay linear, no N×V term): fwd+bwd, eager providers (the compiled
  # reference would recompile for every shape); ceilings reused from the targets run
  SCALING=(--heads qwen0.5b,llama8b,qwen7b --tokens 4096,16384,65536 --modes fwd+bwd)
  SCALING_PROVIDERS=ours,ours-4pass,trl,cce,liger,reference
  SCALING_TIME=(65 100)
  PLOT_TIMEOUT=20
  STATIC_ARCH=""  # this device's architecture
  STATIC_SELECT=(--quick)
  STATIC_TIMEOUT=50
  ON_CPU=""
}
dry_block() {
  DEADLINE=280
  INSTALL_TIMEOUT=60
  PYTEST_SELECT=(-k "(triton or gpu) and (fully_masked or inplace_writes or frozen_weight)")
  PYTEST_WORKERS=0
  PYTEST_TIMEOUT=140
  SUITE_SELECT=(-m "not gpu" -k "chunked_torch_cpu and fwd")
  SUITE_TIMEOUT=40
  SWEEP_ARGS=(--cpu-budget 0.1 --threads 1)
  TARGETS=(--heads tiny --tokens 128 --modes forward,backward,fwd+bwd)
  TARGETS_TIME=(120 160)
  SCALING=(--heads tiny --tokens 64,256 --modes fwd+bwd)
  SCALING_PROVIDERS=ours,ours-4pass,reference  # the peers run in the targets sweep
  SCALING_TIME=(65 100)
  PLOT_TIMEOUT=20
  STATIC_ARCH=90
  STATIC_SELECT=(--default-only --only "^(linear_fwd\[bf16,tf32,split=True,bias=False,\
epi=none,V%16=0\]|linear_dz\[bf16,tf32,vocab,dh=True,dw=True,bias=False,gent=False,\
filter=False,V%16=0\]|accumulate_mm\[bf16,A_T=False,stride_a%16=0\])$")
  STATIC_TIMEOUT=50
  ON_CPU="CPU, float32; CUDA-only providers n/a"
}
use_block device_block dry_block

# run_step FILE TIMEOUT CMD...: CMD's stdout and stderr into $OUT/FILE, then "exit N" there
run_step() {
  local file=$1 cap=$2
  shift 2
  timeout "$cap" "$@" > "$OUT/$file" 2>&1
  echo "exit $?" >> "$OUT/$file"
}

stamp "environment$(dry_says "$ON_CPU")"
write_env
cat "$OUT/env.txt"
if [ "$DRY_RUN" = 1 ]; then stamp "carry size: $(carry_size)"; fi
install_peers "$INSTALL_TIMEOUT"

pytest_step "pytest gpu: ${PYTEST_SELECT[*]}" pytest_gpu.txt "CPU: Triton's interpreter, a \
small selection; gpu-marked tests skip" tests/api/test_fused_linear_grpo.py \
  tests/api/test_logits_grpo.py tests/api/test_selective_logprobs.py \
  tests/api/test_memory_and_properties.py

if ! python -c "import pytest_benchmark" 2> /dev/null; then
  stamp "benchmark suite: skipped, pytest-benchmark not installed (benchmarks/fetch_wheels.sh" \
    "puts its wheel in .whl/)"
elif step_cap "benchmark suite" "$SUITE_TIMEOUT"; then
  stamp "benchmark suite: ${SUITE_SELECT[*]} (timeout ${CAP}s)$(dry_says "CPU cases: the gpu \
cases need CUDA")"
  run_step bench_suite.txt "$CAP" python -m pytest benchmarks/ --benchmark-only -q \
    -p no:cacheprovider "${SUITE_SELECT[@]}" --benchmark-json="$OUT/bench_suite.json"
  tail -n 3 "$OUT/bench_suite.txt"
fi

sweep targets "${TARGETS_TIME[@]}" "${TARGETS[@]}"
sweep scaling "${SCALING_TIME[@]}" "${SCALING[@]}" --providers "$SCALING_PROVIDERS" \
  --no-ceilings

if ! python -c "import matplotlib, PIL" 2> /dev/null; then
  stamp "plots: skipped, matplotlib or PIL not installed (python -m benchmarks.plot draws them" \
    "from results/*.csv elsewhere)"
elif step_cap plots "$(( 2 * PLOT_TIMEOUT ))"; then
  stamp "plots"
  for csv in "$OUT"/results/*.csv; do
    case "$csv" in *-profile.csv) continue ;; esac
    timeout "$PLOT_TIMEOUT" python -m benchmarks.plot "$csv" --out "$OUT/bench_fwd_bwd.png" \
      --mode fwd+bwd
    timeout "$PLOT_TIMEOUT" python -m benchmarks.plot "$csv" --out "$OUT/bench_forward.png" \
      --mode forward
  done
fi

# The static report for this device's architecture (registers, spills, tensor-core ops and the
# time model), to set against the measured rows; compile_check needs no GPU and no interpreter.
if step_cap "static report" "$STATIC_TIMEOUT"; then
  arch="$STATIC_ARCH"
  if [ -z "$arch" ]; then
    arch=$(python -c "import torch; a, b = torch.cuda.get_device_capability(); print(10*a + b)")
  fi
  stamp "static report: sm_$arch ${STATIC_SELECT[*]} (timeout ${CAP}s)$(dry_says "a fixed \
architecture, three default variants")"
  timeout "$CAP" env -u TRITON_INTERPRET python -m grpo_kernels.compile_check --arch "$arch" \
    --report "${STATIC_SELECT[@]}" > "$OUT/static-sm$arch.md" 2> "$OUT/static.log"
  echo "exit $?" >> "$OUT/static.log"
  tail -n 1 "$OUT/static-sm$arch.md"
fi
stamp "done"
