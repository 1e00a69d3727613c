#!/usr/bin/env bash
# The SIGSEGV of APEX_NORM_TUNE's notes (2026-12-05): scripts/debug_tune_segv.py per variant,
# three times each, then under gdb where the machine has it. CACHE_IN as gpu_norm.sh.
source "$(dirname "$0")/gpu_common.sh"
mkdir -p "$APEX_CACHE_DIR"
[ -n "${CACHE_IN:-}" ] && tar xzf "$CACHE_IN" -C "$APEX_CACHE_DIR"
use_sources
export APEX_NORM_TUNE="bogus=1,bwd_lean=two,bwd_wide=4,bwd_ring=-1" PYTHONFAULTHANDLER=1
for v in plain nowarn quiet keep preload; do
  for i in 1 2 3; do
    timeout 120 python3 scripts/debug_tune_segv.py "$v" > "$OUT/segv_${v}_$i.txt" 2>&1
    rc=$?
    echo "$v $i rc=$rc $(grep '^ok' "$OUT/segv_${v}_$i.txt" | cut -c1-200)"
    [ "$rc" = 0 ] || grep -vE "^start" "$OUT/segv_${v}_$i.txt" | head -30 | cut -c1-160
  done
done
APEX_NORM_TUNE='' timeout 120 python3 scripts/debug_tune_segv.py plain 2>&1 | tail -2
if command -v gdb > /dev/null; then
  timeout 150 gdb -q -batch -ex run -ex bt -ex "thread apply all bt 12" --args python3 \
    scripts/debug_tune_segv.py plain > "$OUT/gdb.txt" 2>&1
  grep -E "^#|SIGSEGV" "$OUT/gdb.txt" | head -60
else
  echo "no gdb"
fi
# The two tests that died (their scripts' faulthandler output lands in the assertion message).
APEX_NORM_TUNE='' timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda \
  packages/apex-norm/tests/test_layer_norm.py -k "warn_about or fwd_r80" > "$OUT/tests.txt" 2>&1
tail -1 "$OUT/tests.txt"
grep -E "Fatal|File |Thread|Current thread|Segmentation" "$OUT/tests.txt" | head -60 | cut -c1-200
