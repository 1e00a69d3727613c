#!/usr/bin/env bash
# One GPU call for apex-norm and apex-parallel (2026-12-03): compile, their `cuda` tests, the
# LayerNorm forward's two moment formulas swept (APEX_NORM_TUNE ln_one_pass=0/1), then
# bench_syncbn, the syncbn kernel profile and bench_norm (bf16 every H; fp32 H=4096) with the
# faster formula. Everything under $OUT (bench.tgz holds the tables and the sweep).
#   CACHE_IN=.gl/cache.tgz OUT=dir bash scripts/gpu_final_norm_syncbn.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export OUT=${OUT:-$ROOT/gpu-out} APEX_CACHE_DIR=${APEX_CACHE_DIR:-/tmp/apex-cache}
TESTS="packages/apex-parallel/tests packages/apex-norm/tests" TEST_JOBS=4 TEST_PARALLEL=1 \
  PYTEST_ARGS="-m cuda" SKIP_BENCH=1 bash scripts/gpu_run.sh > "$OUT/run.log" 2>&1
grep -E "compiled|cache in|rc=" "$OUT/summary.txt"
export PYTHONPATH=$(ls -d "$ROOT"/packages/*/src | paste -sd: -)
SWEEP_H=1024,4096,16384 SWEEP_NORMS=layernorm timeout 150 bash scripts/norm_sweep.sh \
  "ln_one_pass=0" "ln_one_pass=1" > "$OUT/norm_sweep.txt" 2>&1
cat "$OUT/norm_sweep.txt"
W=$(python3 - "$OUT/sweep" <<'PY'
import json, sys
tot = []
for i in (1, 2):
    try:
        rows = json.load(open(f"{sys.argv[1]}/{i}/bench_norm.json"))["rows"]
        tot.append(sum(r["ms"] for r in rows if r["case"].endswith(" fwd")))
    except Exception:
        tot.append(float("inf"))
print(1 if tot[1] < tot[0] else 0)
PY
)
echo "LayerNorm forward formula for the benchmarks: ln_one_pass=$W"
export APEX_NORM_TUNE=ln_one_pass=$W
B="$OUT/bench"
mkdir -p "$B/fp32"
timeout 90 python3 packages/apex-parallel/benchmarks/bench_syncbn.py --out "$B" > "$B/syncbn.log" 2>&1
timeout 60 python3 scripts/profile_gpu.py syncbn 2>&1 | grep -v -e UserWarning -e _warn_once > "$OUT/prof_syncbn.txt"
timeout 260 python3 packages/apex-norm/benchmarks/bench_norm.py --out "$B" --dtypes bf16 > "$B/norm.log" 2>&1
timeout 90 python3 packages/apex-norm/benchmarks/bench_norm.py --out "$B/fp32" --dtypes fp32 --hidden 4096 \
  > "$B/norm32.log" 2>&1
mv "$OUT/sweep" "$B/" 2>/dev/null
tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$B"
echo "== done $(date -u +%FT%TZ)"
