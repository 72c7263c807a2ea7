#!/usr/bin/env bash
# The accelerator check of issue 20, as one command: the suite's accelerator-only tests (the
# compiled FP4 Pallas kernel against the reference; they skip without a GPU), then
# experiments/bench_gpu.py. Installs nothing: it runs the checkout with the machine's python3
# (JAX with CUDA, flax, optax, absl, pytest); the package is found through PYTHONPATH.
#
#   bash experiments/gpu_check.sh RESULTS_DIR [extra bench_gpu.py flags]
#   bash experiments/gpu_check.sh RESULTS_DIR --dry_run      # CPU rehearsal of the same steps
#
# Writes to RESULTS_DIR: env.txt (machine, versions), pytest_accelerator.log and .xml,
# bench.log and gpu_bench.json (gpu_dryrun.json with --dry_run). Exit status: 0 when the
# accelerator tests ran and passed and the benchmark wrote its JSON; else 1.
# Time: under a minute of tests, then the benchmark's budget (--time_budget_s, default 300 s)
# plus the measurement under way when it runs out: about 6 to 7 min in all. Hard limits below
# (180 s + 400 s) keep the whole command inside a 10-minute call.
set -u -o pipefail

out="${1:?usage: gpu_check.sh RESULTS_DIR [bench_gpu.py flags]}"
shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
repo="$(pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

dry=0
for a in "$@"; do [ "$a" = "--dry_run" ] && dry=1; done
if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS=cpu
  json="$out/gpu_dryrun.json"
else
  # The tests' conftest defaults JAX_PLATFORMS to cpu; the accelerator run must say cuda.
  export JAX_PLATFORMS=cuda
  json="$out/gpu_bench.json"
fi

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) (working tree may differ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
  "$PY" -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0]); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print("devices", jax.devices())' 2>&1
  "$PY" -c 'import flax, optax; print("flax", flax.__version__, "optax", optax.__version__)' 2>&1
} > "$out/env.txt"
cat "$out/env.txt"

status=0
echo "== accelerator-only tests (tests/kernels: compiled kernel vs reference)"
# test_compiled_matches_reference skips on CPU; on the GPU it must run and pass.
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -rs tests/kernels/test_fp4_pallas.py \
  -k "compiled_matches_reference" --junitxml="$out/pytest_accelerator.xml" 2>&1 | tee "$out/pytest_accelerator.log"
rc=$?
if [ "$rc" -ne 0 ]; then
  echo "accelerator tests failed (exit $rc)"; status=1
elif [ "$dry" = 0 ] && grep -q 'skipped="[1-9]' "$out/pytest_accelerator.xml"; then
  echo "accelerator tests were SKIPPED: no GPU seen by JAX"; status=1
fi

echo "== bench_gpu.py"
# Hard stop 100 s past the benchmark's own budget; the JSON is rewritten after every measurement.
timeout 400 "$PY" experiments/bench_gpu.py --out="$json" "$@" 2>&1 | tee "$out/bench.log"
rc=$?
if [ "$rc" -ne 0 ] || [ ! -s "$json" ]; then
  echo "bench_gpu.py failed (exit $rc)"; status=1
fi
echo "gpu_check: status $status; results in $out"
exit $status
