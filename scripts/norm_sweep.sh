#!/usr/bin/env bash
# Tuning sweep of the apex-norm kernels' launch knobs (APEX_NORM_TUNE, read once per process) on
# a GPU machine, from source: one bench_norm process per setting, ours only, and a table of
# device time (CUDA-graph replays) and % of copy per case.
#   OUT=dir bash scripts/norm_sweep.sh ["fwd_pt=4,bwd_pt=2" "fwd_pt=2,bwd_pt=1" ...]
#   SWEEP_H=8192,16384 SWEEP_DT=bf16 SWEEP_NORMS=layernorm: the cases swept (defaults: 1024,4096,16384; bf16; both)
#   SWEEP_PASSES=fwd: the passes timed (default fwd,fwd+bwd)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}/sweep
mkdir -p "$OUT"
export PYTHONPATH=$(ls -d "$ROOT"/packages/*/src | paste -sd: -)
# gpu_common.sh's kernel cache, so a sweep after gpu_norm.sh or gpu_run.sh compiles nothing (in
# another cache the first setting's process compiled and ran past its time limit, 12-04 14:18).
export APEX_CACHE_DIR=${APEX_CACHE_DIR:-/tmp/apex-cache}
SETTINGS=("$@")
[ ${#SETTINGS[@]} -eq 0 ] && SETTINGS=("fwd_pt=4,bwd_pt=2" "fwd_pt=2,bwd_pt=1" "fwd_pt=8,bwd_pt=4" "fwd_waves=64,bwd_waves=64")
i=0
for t in "${SETTINGS[@]}"; do
  i=$((i + 1))
  APEX_NORM_TUNE=$t timeout 120 python3 "$ROOT/packages/apex-norm/benchmarks/bench_norm.py" \
    --out "$OUT/$i" --impls ours --hidden "${SWEEP_H:-1024,4096,16384}" --dtypes "${SWEEP_DT:-bf16}" \
    --norms "${SWEEP_NORMS:-rmsnorm,layernorm}" --passes "${SWEEP_PASSES:-fwd,fwd+bwd}" \
    > "$OUT/$i.log" 2>&1 || echo "setting $t failed: see $OUT/$i.log"
  python3 - "$OUT/$i/bench_norm.json" "$t" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(f"{sys.argv[2]:28s} {r['case']:36s} {r['ms']:.4f} ms {r['pct_copy']:6.1f} %")
PY
done
