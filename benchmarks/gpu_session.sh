#!/usr/bin/env bash
# One call on a machine with a CUDA device (H100/H200): GPU tests, the benchmark sweep, the plot.
# Designed to finish inside a 10-minute command limit (worst case 60+140+40+160+100+40+50 s =
# 590 s plus start-up): every step has its own `timeout`, and the
# sweeps stop starting new (provider, shape) pairs when their --time-budget runs out. Rows are
# appended as they are measured, so a step cut short still leaves its numbers.
#
# Usage (repository root; OUT = where results go, default ./gpu_out):
#   BENCH_COMMIT=<short sha> OUT=/some/dir bash benchmarks/gpu_session.sh
# BENCH_COMMIT names the commit in every CSV row when the tree copy has no .git.
# The peers (TRL, Cut Cross-Entropy, Liger-Kernel) are not on the device image: fetch their wheels
# with benchmarks/fetch_wheels.sh on a networked machine and carry .whl; install_wheels.sh installs
# them here. Without them those rows read "n/a: ... not installed". benchmarks/gpu_peers.sh is
# the shorter call that compares only the fused linear loss with these peers.
#
# Writes under $OUT:
#   env.txt                  nvidia-smi, versions, commit
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

stamp "environment"
write_env
cat "$OUT/env.txt"

stamp "installing the peers from .whl/"
timeout 60 bash benchmarks/install_wheels.sh >> "$OUT/env.txt" 2>&1
tail -n 3 "$OUT/env.txt"

stamp "pytest -m gpu"
# the API matrices launch the Triton backend on the GPU (tests/helpers.py: KERNEL_DEVICE); on an
# H100 with 8 workers they took 92 s
workers=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 140 python -m pytest -q -ra $workers -p no:cacheprovider tests/api/test_fused_linear_grpo.py \
  tests/api/test_logits_grpo.py tests/api/test_selective_logprobs.py \
  tests/api/test_memory_and_properties.py -k "triton or gpu" > "$OUT/pytest_gpu.txt" 2>&1
echo "exit $?" >> "$OUT/pytest_gpu.txt"
tail -n 5 "$OUT/pytest_gpu.txt"

stamp "pytest-benchmark suite (gpu cases)"
timeout 40 python -m pytest benchmarks/ --benchmark-only -m gpu -q \
  --benchmark-json="$OUT/bench_suite.json" > "$OUT/bench_suite.txt" 2>&1
echo "exit $?" >> "$OUT/bench_suite.txt"
tail -n 3 "$OUT/bench_suite.txt"

# The targets first (the issue's numbers: N=16384, Qwen2.5-0.5B and Llama-3-8B heads, bf16),
# all providers and modes; torch.compile of the reference is last inside each shape (compile
# time is what most often runs a budget out).
stamp "sweep: targets"
timeout 160 python -m benchmarks --quick --modes forward,backward,fwd+bwd \
  --out "$OUT/results" --time-budget 120 --markdown > "$OUT/targets.md" 2> "$OUT/targets.log"
echo "exit $?" >> "$OUT/targets.log"
tail -n 4 "$OUT/targets.log"

# Scaling in N (memory must stay linear, no N×V term): fwd+bwd only, eager providers (compiled
# reference would recompile for every shape); ceilings reused from the targets run.
stamp "sweep: scaling"
timeout 100 python -m benchmarks --heads qwen0.5b,llama8b,qwen7b --tokens 4096,16384,65536 \
  --modes fwd+bwd --providers ours,trl,cce,liger,reference --no-ceilings --out "$OUT/results" \
  --time-budget 65 --markdown > "$OUT/scaling.md" 2> "$OUT/scaling.log"
echo "exit $?" >> "$OUT/scaling.log"
tail -n 4 "$OUT/scaling.log"

stamp "plots"
for csv in "$OUT"/results/*.csv; do
  timeout 20 python -m benchmarks.plot "$csv" --out "$OUT/bench_fwd_bwd.png" --mode fwd+bwd
  timeout 20 python -m benchmarks.plot "$csv" --out "$OUT/bench_forward.png" --mode forward
done
# The static report for this device's architecture (registers, spills, tensor-core ops and the
# time model), to set against the measured rows; compile_check needs no GPU and no interpreter.
stamp "static report"
arch=$(python -c "import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)")
timeout 50 env -u TRITON_INTERPRET python -m grpo_kernels.compile_check --arch "$arch" --quick \
  --report > "$OUT/static-sm$arch.md" 2> "$OUT/static.log"
echo "exit $?" >> "$OUT/static.log"
tail -n 1 "$OUT/static-sm$arch.md"
stamp "done"
