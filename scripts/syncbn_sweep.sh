#!/usr/bin/env bash
# Sweep of the apex-parallel SyncBatchNorm kernels' knobs (APEX_SYNCBN_TUNE, read once per
# process) on a GPU machine, from source: one scripts/profile_gpu.py syncbn process per setting
# (each kernel's device time, x = [64, 256, 56, 56], bf16 and fp32, both layouts), gathered in
# $OUT/sweep_syncbn.txt.
#   OUT=dir bash scripts/syncbn_sweep.sh ["ew_pf=0,red_pf=0" "ew_pf=1,red_pf=1" ...]
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$(ls -d "$ROOT"/packages/*/src | paste -sd: -)
SETTINGS=("$@")
[ ${#SETTINGS[@]} -eq 0 ] && SETTINGS=("ew_pf=0,red_pf=0" "ew_pf=1,red_pf=1" "ew_pf=2,red_pf=2")
for t in "${SETTINGS[@]}"; do
  echo "### APEX_SYNCBN_TUNE=$t" >> "$OUT/sweep_syncbn.txt"
  APEX_SYNCBN_TUNE=$t timeout 120 python3 "$ROOT/scripts/profile_gpu.py" syncbn 2>&1 \
    | grep -v -e "UserWarning" -e "_warn_once" >> "$OUT/sweep_syncbn.txt" || echo "setting $t failed"
done
