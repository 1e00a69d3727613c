#!/usr/bin/env bash
# One GPU call for the apex-norm forward (2026-12-04): compile, the `cuda` tests of apex-norm,
# a sweep of the forward's register cap and fixed-dtype kernels (APEX_NORM_TUNE fwd_maxreg,
# fwd_same) and of the backward's vectors per thread at H=1024, then the host cost per eager
# call (scripts/host_norm.py). Everything under $OUT.
#   CACHE_IN=.gl/cache.tgz OUT=dir bash scripts/gpu_norm_fwd.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export OUT=${OUT:-$ROOT/gpu-out} APEX_CACHE_DIR=${APEX_CACHE_DIR:-/tmp/apex-cache}
TESTS="packages/apex-norm/tests=240" TEST_JOBS=6 TEST_PARALLEL=1 \
  PYTEST_ARGS="-m cuda" SKIP_BENCH=1 bash scripts/gpu_run.sh > "$OUT/run.log" 2>&1
grep -E "compiled|cache in|rc=|passed|failed" "$OUT/summary.txt" | tail -8
export PYTHONPATH=$(ls -d "$ROOT"/packages/*/src | paste -sd: -)
SWEEP_H=1024,2048,4096,16384 timeout 200 bash scripts/norm_sweep.sh \
  "fwd_maxreg=0" "fwd_maxreg=80" "fwd_same=0" > "$OUT/sweep_fwd.txt" 2>&1
grep " fwd " "$OUT/sweep_fwd.txt"
SWEEP_H=1024 timeout 60 bash scripts/norm_sweep.sh "bwd_pt16=1" "bwd_pt16=4" > "$OUT/sweep_bwd.txt" 2>&1
grep "fwd+bwd" "$OUT/sweep_bwd.txt" "$OUT/sweep_fwd.txt" | grep "1024\]"
timeout 60 python3 scripts/host_norm.py 1024 > "$OUT/host_norm.txt" 2>&1
head -60 "$OUT/host_norm.txt"
rm -rf "$OUT/sweep"
echo "== done $(date -u +%FT%TZ)"
