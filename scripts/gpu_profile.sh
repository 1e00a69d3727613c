#!/usr/bin/env bash
# Profiles on the GPU machine, after scripts/gpu_run.sh has compiled the kernels (same
# APEX_CACHE_DIR): scripts/profile_gpu.py's amp, syncbn and norm tables, and an ncu look at the
# norm backward where ncu can read the counters. Writes prof_*.txt and ncu_<target>.txt under $OUT
# (NCU_TARGET: profile_gpu.py's norm-one or syncbn-one; NCU_KERNEL: a regex of kernel names).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
export APEX_CACHE_DIR=${APEX_CACHE_DIR:-/tmp/apex-cache}  # where gpu_run.sh compiled them
export PYTHONPATH=$(ls -d "$ROOT"/packages/*/src | paste -sd: -)
for p in ${PROFILES:-amp syncbn norm}; do
  timeout 180 python3 "$ROOT/scripts/profile_gpu.py" "$p" > "$OUT/prof_$p.txt" 2>&1 || echo "profile $p: rc=$?"
done
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  timeout 180 ncu --clock-control none -k "regex:${NCU_KERNEL:-bwd_}" -c "${NCU_COUNT:-2}" \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats \
    python3 "$ROOT/scripts/profile_gpu.py" "${NCU_TARGET:-norm-one}" > "$OUT/ncu_${NCU_TARGET:-norm-one}.txt" 2>&1 || echo "ncu: rc=$?"
fi
