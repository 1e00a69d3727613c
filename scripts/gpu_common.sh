# Sourced by the per-package GPU scripts (gpu_norm.sh, gpu_syncbn.sh): the repository root as the
# working folder, $OUT and the kernel cache folder, cuda_tests, compile_only and use_sources.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export OUT=${OUT:-$ROOT/gpu-out} APEX_CACHE_DIR=${APEX_CACHE_DIR:-/tmp/apex-cache}
mkdir -p "$OUT"

# cuda_tests "DIR=SECONDS": gpu_run.sh compiles every extension (CACHE_IN: an earlier run's
# kernels), then runs DIR's `cuda` tests with 6 workers; prints the compile and test lines,
# then use_sources.
# The packages run side by side where the GPU has 100 GiB or more (H200); on an 80 GiB H100 six
# workers a package for five packages ran out of memory (12-05 05:4x), so one package at a time
# there (TEST_PARALLEL overrides).
cuda_tests() {
  local mib par
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  par=${TEST_PARALLEL:-$([ "${mib:-0}" -ge 100000 ] && echo 1 || echo 0)}
  TESTS="$1" TEST_JOBS=6 TEST_PARALLEL=$par PYTEST_ARGS="-m cuda" SKIP_BENCH=1 \
    bash scripts/gpu_run.sh > "$OUT/run.log" 2>&1
  grep -E "compiled|cache in|rc=|passed|failed" "$OUT/summary.txt" | tail -8
  use_sources
}

# compile_only: gpu_run.sh's compile stage alone (no tests, no benchmarks), then use_sources.
compile_only() {
  SKIP_TESTS=1 SKIP_BENCH=1 bash scripts/gpu_run.sh > "$OUT/run.log" 2>&1
  grep -E "compiled|cache in|compile wall|FAILED" "$OUT/summary.txt" | tail -8
  use_sources
}

# sources_of DIR: the PYTHONPATH of every package's sources in the tree at DIR.
sources_of() { ls -d "$1"/packages/*/src | paste -sd: -; }

# PYTHONPATH on every package's sources, for what follows.
use_sources() {
  PYTHONPATH=$(sources_of "$ROOT")
  export PYTHONPATH
}
