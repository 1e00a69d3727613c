#!/usr/bin/env bash
# The GPU runner: on a machine with a GPU and no network, from source (no install step), it
# compiles every kernel, runs every test including the `cuda`-marked ones, runs the benchmarks,
# and writes logs and tables under $OUT (default ./gpu-out).
#
#   bash scripts/gpu_run.sh                      # everything
#   TESTS="packages/apex-mta-kernels/tests" BENCH="bench_scale" bash scripts/gpu_run.sh
#   PROVE_LOCK=1 ...                             # also: 8 processes started together compile once
#   SKIP_TESTS=1 / SKIP_BENCH=1                  # leave a stage out
#   CACHE_IN=.gl/cache.tgz                       # start from the kernels an earlier run saved
#   BENCH_TIMEOUT=120                            # seconds per benchmark script
#   BENCH_ARGS_bench_norm="--profile"            # extra arguments for one benchmark script
#   DEMO="--skip-cnn" DEMO_TIMEOUT=200           # also demo/run_demo.py on the GPU (demo.tgz)
#   TEST_JOBS=6                                  # one pytest per package, 6 xdist workers
#   TESTS="packages/apex-optim/tests=120 ..."   # with TEST_JOBS: a time limit per package
#   TEST_PARALLEL=1                              # with TEST_JOBS: the packages side by side
#
# Outputs (few files on purpose): summary.txt (environment, report, compile times, test summary,
# benchmark tables), pytest.log, compile.log, bench.md, bench.json, and bench.tgz holding
# bench/<name>.{md,json} (tools/bench_report.py turns those into the docs' tables and plots).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SRCS=$(ls -d "$ROOT"/packages/*/src | paste -sd: -)
export PYTHONPATH="$SRCS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export APEX_CACHE_DIR=${APEX_CACHE_DIR:-/tmp/apex-cache}
export APEX_STRICT_KERNELS=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

say "== environment $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$SUMMARY"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$SUMMARY"
$PY -m apex.multi_tensor_apply report 2>&1 | tee -a "$SUMMARY"

# A kernel cache brought back by an earlier call (CACHE_IN=.gl/cache.tgz, the folder carried):
# the device is a fresh machine after 30 s idle, and compiling costs minutes of device time.
if [ -n "${CACHE_IN:-}" ] && [ -f "$CACHE_IN" ]; then
  mkdir -p "$APEX_CACHE_DIR" && tar xzf "$CACHE_IN" -C "$APEX_CACHE_DIR" && say "cache restored from $CACHE_IN"
fi
say "== compile (cold: one process per extension, side by side)"
LOAD='
import os, time, torch
t = time.perf_counter()
from apex.multi_tensor_apply.build import aot, loader
only = os.environ.get("ONLY_SPEC")
for spec in aot.discover_specs():
    if only and spec.name != only:
        continue
    e = loader.load(spec)
    print(f"{spec.name}: {e.origin} in {time.perf_counter() - t:.2f} s ({e.path})")
'
NAMES=$($PY -c "from apex.multi_tensor_apply.build import aot; print(' '.join(s.name for s in aot.discover_specs()))")
: > "$OUT/compile.log"
rc=0
T0=$SECONDS
for n in $NAMES; do ONLY_SPEC=$n $PY -c "$LOAD" > "$OUT/compile-$n.log" 2>&1 & done
for job in $(jobs -p); do wait "$job" || rc=$?; done
for n in $NAMES; do cat "$OUT/compile-$n.log" >> "$OUT/compile.log"; rm -f "$OUT/compile-$n.log"; done
tee -a "$SUMMARY" < "$OUT/compile.log" | grep -E "apex:|: (compiled|cache|prebuilt)" || true
say "compile wall: $((SECONDS - T0)) s"
if [ $rc -ne 0 ]; then say "COMPILE FAILED (rc=$rc); see compile.log"; tail -50 "$OUT/compile.log"; fi
say "== load from cache (second process)"
$PY -c "$LOAD" 2>&1 | tee -a "$SUMMARY"
# The finished libraries and their markers only (no object files), for CACHE_IN next time: only
# the builds this run loaded (compile.log names each one's path), not those restored from CACHE_IN
# for other sources (with them the archive grew past the 16 MiB a file the device sends back).
LOADED=$(grep -oE "\($APEX_CACHE_DIR/[^/]+/" "$OUT/compile.log" | sed -E "s|^\($APEX_CACHE_DIR/||; s|/\$||" | sort -u)
[ -n "$LOADED" ] || LOADED=.
# shellcheck disable=SC2086  # one folder per word
(cd "$APEX_CACHE_DIR" && find $LOADED \( -name '*.so' -o -name build.json \) | tar czf "$OUT/cache.tgz" -T -) \
  && say "cache saved: $(du -h "$OUT/cache.tgz" | cut -f1) ($(echo $LOADED | wc -w) builds)"

if [ "${PROVE_LOCK:-0}" = 1 ]; then
  say "== 8 processes started together, fresh cache"
  LOCKDIR=$(mktemp -d)
  for i in $(seq 8); do APEX_CACHE_DIR=$LOCKDIR $PY -c "$LOAD" > "$LOCKDIR/p$i.log" 2>&1 & done
  wait
  say "compiling lines: $(cat "$LOCKDIR"/p*.log | grep -c 'apex: compiling') (expect one per extension)"
  say "origins: $(cat "$LOCKDIR"/p*.log | grep -oE ': (compiled|cache) in' | sort | uniq -c | tr '\n' ' ')"
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # One OpenMP thread per test process, as nox runs them (noxfile.py PYTEST_ENV): several
  # pytests with xdist workers on 16 cores would otherwise spin hundreds of threads.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  TESTS=${TESTS:-$(ls -d packages/*/tests)}
  : > "$OUT/pytest.log"
  if [ -n "${TEST_JOBS:-}" ]; then
    # One pytest per package with xdist workers: a crash costs one worker, which xdist replaces.
    say "== tests (one pytest per package, $TEST_JOBS workers each)"
    # TEST_PARALLEL=1: the packages' pytests run side by side (the GPU and 16 cores have room),
    # each logging to its own file, appended to pytest.log in order afterwards.
    pkg_log() { echo "$OUT/pytest-$(basename "$(dirname "${1%%=*}")").log"; }
    run_pkg() {
      local entry=$1 d limit log
      d=${entry%%=*}; limit=${TEST_TIMEOUT:-3600}
      [ "$entry" != "$d" ] && limit=${entry#*=}
      log=$(pkg_log "$entry")
      echo "### $d (limit ${limit} s)" > "$log"
      # An entry may carry its own time limit, packages/x/tests=120; SIGINT at the limit makes
      # pytest stop and still print what failed so far.
      (cd "$d/.." && timeout -s INT -k 15 "$limit" $PY -m pytest -p no:cacheprovider -rs -q \
        --timeout=900 -n "$TEST_JOBS" tests ${PYTEST_ARGS:-}) >> "$log" 2>&1
      echo "rc=$?" >> "$log"
    }
    for entry in $TESTS; do
      if [ "${TEST_PARALLEL:-0}" = 1 ]; then run_pkg "$entry" & else run_pkg "$entry"; fi
    done
    wait
    for entry in $TESTS; do
      d=${entry%%=*}
      log=$(pkg_log "$entry")
      cat "$log" >> "$OUT/pytest.log"
      line=$(grep -E "(passed|failed|error)" "$log" | tail -1)
      say "$(printf '%-40s %-6s %s' "$d" "$(tail -1 "$log")" "$line")"
      rm -f "$log"
    done
  else
    say "== tests (one pytest process per file, so a crash costs one file, not the run)"
    # shellcheck disable=SC2086
    for f in $(find $TESTS -name 'test_*.py' | sort); do
      echo "### $f" >> "$OUT/pytest.log"
      $PY -m pytest -p no:cacheprovider -rs -q --timeout=900 "$f" ${PYTEST_ARGS:-} >> "$OUT/pytest.log" 2>&1
      rc=$?
      line=$(grep -E "^[0-9]+ (passed|failed)|passed|failed|error" "$OUT/pytest.log" | tail -1)
      say "$(printf '%-60s rc=%-3s %s' "$f" "$rc" "$line")"
    done
  fi
  say "-- failures"
  grep -E "^(FAILED|ERROR)|Fatal Python error" "$OUT/pytest.log" | head -40 | tee -a "$SUMMARY"
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  say "== benchmarks"
  BDIR="$OUT/bench"
  mkdir -p "$BDIR"
  for b in packages/*/benchmarks/bench_*.py; do
    name=$(basename "$b" .py)
    if [ -n "${BENCH:-}" ] && ! echo " $BENCH " | grep -q " $name "; then continue; fi
    say "-- $name"
    T0=$SECONDS
    extra="BENCH_ARGS_$name"  # e.g. BENCH_ARGS_bench_norm="--profile --hidden 1024,4096"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-1800}" $PY "$b" --out "$BDIR" ${!extra:-} 2>&1 | tee -a "$SUMMARY"
    say "$name: rc=${PIPESTATUS[0]} in $((SECONDS - T0)) s"
  done
  cat "$BDIR"/*.md > "$OUT/bench.md" 2>/dev/null || true
  $PY - "$BDIR" "$OUT/bench.json" <<'PYEOF'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
json.dump({p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))},
          open(sys.argv[2], "w"), indent=1)
PYEOF
fi
if [ -n "${DEMO:-}" ]; then
  # DEMO="--skip-cnn": demo/run_demo.py on the GPU with those arguments (one GPU: the 2-process
  # CNN part would run on the CPU with gloo, as in CI), its output packed as demo.tgz.
  say "== demo ($DEMO)"
  # shellcheck disable=SC2086
  timeout "${DEMO_TIMEOUT:-300}" $PY demo/run_demo.py --device cuda --out "$OUT/demo" $DEMO 2>&1 \
    | tr '\r' '\n' | grep -vE '[0-9]+/[0-9]+ \[' | tee -a "$SUMMARY"
  say "demo: rc=${PIPESTATUS[0]}"
  tar czf "$OUT/demo.tgz" -C "$OUT" demo && rm -rf "$OUT/demo"
fi
# The device tool brings back at most 8 files from $OUT: pack the per-benchmark files.
if [ -d "$OUT/bench" ]; then
  tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
fi
say "== done $(date -u +%FT%TZ)"
