#!/usr/bin/env bash
# One GPU call for apex-norm (2026-12-04): compile, the `cuda` tests of apex-norm, then, each
# when asked: SWEEP=1 the forward's register caps and fixed-dtype kernels (APEX_NORM_TUNE fwd_r80)
# and the backward's vectors per thread at H=1024; HOST=1 the host cost per eager call
# (scripts/host_norm.py); BENCH=1 bench_norm (bf16 every H, fp32 H=4096; ours, torch eager,
# torch.compile); FWD_SWEEP=1 / BWD_SWEEP=1 the forward's and backward's launch shapes (ours
# only, scripts/norm_sweep.sh); SHAPES=1 the launch shapes of ours and torch.compile's kernels
# (scripts/norm_kernel_shapes.py); NO_TESTS=1 compiles without the tests. Everything under $OUT
# (bench.tgz holds the benchmark tables).
#   CACHE_IN=.gl/cache.tgz HOST=1 BENCH=1 OUT=dir bash scripts/gpu_norm.sh
source "$(dirname "$0")/gpu_common.sh"
if [ "${NO_TESTS:-0}" = 1 ]; then
  compile_only
else
  cuda_tests "packages/apex-norm/tests=240"
fi
if [ "${FWD_SWEEP:-0}" = 1 ]; then
  # The forward's shapes (2026-12-04): both norms through fwd_fast_r80 (fwd_r80=3) or RMSNorm
  # through fwd_fast's LEAN variant (1), LayerNorm bf16 at 2 and 4 vectors a thread without the
  # 80-register cap; float32 at 4 vectors a thread (the old default) against 2.
  SWEEP_PASSES=fwd SWEEP_H=1024,2048,4096,8192,16384 timeout 240 bash scripts/norm_sweep.sh \
    "fwd_r80=3" "fwd_r80=1" "fwd_pt16=4,fwd_r80=0" "fwd_pt16=2,fwd_r80=0" "fwd_r80=3,rms_short_pt16=0" \
    "fwd_r80=3" > "$OUT/sweep_fwd.txt" 2>&1
  SWEEP_DT=fp32 SWEEP_H=1024,4096,16384 timeout 100 bash scripts/norm_sweep.sh "fwd_pt=4" "fwd_pt=2" \
    > "$OUT/sweep_fwd32.txt" 2>&1
  cat "$OUT/sweep_fwd.txt" "$OUT/sweep_fwd32.txt" | grep " ms "
  rm -rf "$OUT/sweep"
fi
if [ "${BWD_SWEEP:-0}" = 1 ]; then
  # The backward's row groups (2026-12-04): fewer rows per group (more blocks in flight, more
  # float32 partials), and the 80-register ring at every row width.
  SWEEP_PASSES=fwd+bwd SWEEP_H=1024,2048,4096,8192 timeout 300 bash scripts/norm_sweep.sh \
    "bwd_min_rows=32" "bwd_min_rows=16" "bwd_min_rows=8" "bwd_min_rows=4" "bwd_min_rows=8,bwd_r80=5" \
    "bwd_min_rows=8,bwd_r80=7" "bwd_min_rows=32" > "$OUT/sweep_bwd.txt" 2>&1
  grep " ms " "$OUT/sweep_bwd.txt"
  rm -rf "$OUT/sweep"
fi
if [ "${NCU:-0}" = 1 ]; then
  # Nsight Compute on the 16-bit forward and ring backward kernels of both norms at H = 4096
  # (one launch each; hardware counters where the machine's runtime lets ncu read them).
  timeout 240 ncu --clock-control none -k regex:"fwd_fast|bwd_ring" --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats python3 scripts/ncu_norm_driver.py 4096 > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "fwd_fast|bwd_ring|Throughput|Duration|Stall|Achieved Occupancy|Registers|Eligible|Issued Warp|One or More|No Eligible|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit" "$OUT/ncu.txt" | cut -c1-150
fi
if [ "${BWD_LEAN:-0}" = 1 ]; then
  # The ring backward's LEAN variant (weight, bias and grad_input in the input's dtype) against
  # the general one, and RMSNorm's one-value group sums in both (2026-12-04).
  SWEEP_PASSES=fwd+bwd SWEEP_H=1024,2048,4096,8192 timeout 150 bash scripts/norm_sweep.sh "bwd_lean=1" \
    "bwd_lean=0" "bwd_lean=1" "bwd_lean=0" > "$OUT/sweep_lean.txt" 2>&1
  grep " ms " "$OUT/sweep_lean.txt"
  rm -rf "$OUT/sweep"
fi
if [ "${BWD_PT4:-0}" = 1 ]; then
  # The backward at 4 vectors a thread (the ring with LayerNorm's bias sums in shared memory) on
  # rows of H = 4096 and 8192, against the default 2.
  SWEEP_PASSES=fwd+bwd SWEEP_H=4096,8192 timeout 120 bash scripts/norm_sweep.sh "bwd_pt16=2" "bwd_pt16=4" \
    "bwd_pt16=2" > "$OUT/sweep_bwd4.txt" 2>&1
  grep " ms " "$OUT/sweep_bwd4.txt"
  rm -rf "$OUT/sweep"
fi
if [ "${SHAPES:-0}" = 1 ]; then
  timeout 240 python3 scripts/norm_kernel_shapes.py > "$OUT/shapes.txt" 2>&1
  grep " us " "$OUT/shapes.txt" | cut -c1-200
fi
if [ "${SWEEP:-0}" = 1 ]; then
  SWEEP_H=1024,2048,4096,16384 timeout 200 bash scripts/norm_sweep.sh \
    "fwd_r80=0" "fwd_r80=1" "fwd_r80=3" > "$OUT/sweep_fwd.txt" 2>&1
  grep " fwd " "$OUT/sweep_fwd.txt"
  SWEEP_H=1024 timeout 60 bash scripts/norm_sweep.sh "bwd_pt16=1" "bwd_pt16=4" > "$OUT/sweep_bwd.txt" 2>&1
  grep "fwd+bwd" "$OUT/sweep_bwd.txt" "$OUT/sweep_fwd.txt" | grep "1024\]"
  rm -rf "$OUT/sweep"
fi
if [ "${HOST:-0}" = 1 ]; then
  timeout 60 python3 scripts/host_norm.py 1024 > "$OUT/host_norm.txt" 2>&1
  head -14 "$OUT/host_norm.txt"
fi
if [ "${BENCH:-0}" = 1 ]; then
  B="$OUT/bench"
  mkdir -p "$B/fp32"
  timeout 250 python3 packages/apex-norm/benchmarks/bench_norm.py --out "$B" --dtypes bf16 > "$B/norm.log" 2>&1
  timeout 70 python3 packages/apex-norm/benchmarks/bench_norm.py --out "$B/fp32" --dtypes fp32 --hidden 4096 \
    > "$B/norm32.log" 2>&1
  grep -E "^\| (rms|layer)norm" "$B/bench_norm.md" | awk -F'|' '{printf "%-44s %-8s %8s %7s %7s\n", $3, $4, $5, $8, $13}'
  grep -E "^\| (rms|layer)norm" "$B/fp32/bench_norm.md" | awk -F'|' '{printf "%-44s %-8s %8s %7s %7s\n", $3, $4, $5, $8, $13}'
  tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$B"
fi
echo "== done $(date -u +%FT%TZ)"
