#!/usr/bin/env bash
# One GPU call for apex-norm (2026-12-04): compile, the `cuda` tests of apex-norm, then, each
# when asked (ours only unless said; sweeps through scripts/norm_sweep.sh, one process per
# APEX_NORM_TUNE setting):
#   FWD_SWEEP=1  the forward's register caps and vectors per thread, float32's vectors per thread
#   BWD_SWEEP=1  the backward's register caps and row widths
#   BWD_LEAN=1   the ring backward's LEAN variant against the general one
#   HINT_SWEEP=1 the 16-bit forward's cache hints (fwd_hint), every H
#   RING4_SWEEP=1 LayerNorm's 4-vector ring: bwd_bias4 at H = 8192 / 12288 / 16384
#   WIDE_SWEEP=1 LayerNorm's bf16 backward with bwd_ring_wide (bwd_wide=3, the default: where an
#                SM holds 32 of its warps) against without (0), H = 2048 / 4096 / 8192 / 12288 / 16384
#   SWEEP_SETTINGS="a=1 a=2 ..."  any APEX_NORM_TUNE settings, one process each (SWEEP_PASSES,
#                SWEEP_H, SWEEP_NORMS, SWEEP_DT as norm_sweep.sh reads them; exported for the
#                whole call, they also narrow the stages that do not set their own, BASE's A/B
#                included; SWEEP_SECONDS: its time limit, default 300)
#   NCU=1        Nsight Compute on the 16-bit forward and ring backward at H = 4096 (NCU_H: another
#                H; NCU_K: the kernel-name regex, default "fwd_fast|bwd_ring")
#   SHAPES=1     launch shapes, registers and occupancy of ours and torch.compile's kernels
#   HOST=1       the host cost per eager call (scripts/host_norm.py)
#   WALL=1       one eager forward+backward's timeline at H=1024, ours and torch's (wall_trace_norm.py)
#   HOST_BIG=1   the host cost per eager call at [4, H] and [32768, H], the allocator's device
#                calls, the profiler's runtime calls (scripts/host_big_norm.py)
#   FLOOR=1      the wall target's floor at H=1024: an eager forward+backward of next to no work
#                against each module's wall, steady wall and backward time (wall_floor_norm.py)
#   BENCH=1      bench_norm (bf16 every H, fp32 H=4096; ours, torch eager, torch.compile)
#   BENCH=each   the same, one run per H (4096, 8192, 16384, 2048, 1024, then fp32), each run
#                whole or not at all; DEADLINE=s stops starting runs s seconds after the start;
#                BENCH_CASES="bf16:1024 fp32:4096": those cases only (a call cut short's rest)
#   NO_TESTS=1   compile only, no tests
#   TEST_DIRS="packages/apex-norm/tests=240 packages/apex-parallel/tests=200 ..."  the `cuda`
#                tests of these packages (side by side, a time limit each; default apex-norm's)
#   BASE=dir     ours from another source tree (dir holds its packages/ and scripts/, e.g. an
#                earlier commit's: `git archive REV packages scripts | tar x -C .gl/base`, carried)
#                against this one, alternating, in the same run (bf16, every H, both passes);
#                its kernels compile in the background while the tests run (AB_PASSES=fwd+bwd:
#                that pass only; AB_NEW="knob=v,...": this tree under that APEX_NORM_TUNE)
# Everything under $OUT (bench.tgz holds the benchmark tables).
#   CACHE_IN=.gl/cache.tgz HOST=1 BENCH=1 OUT=dir bash scripts/gpu_norm.sh
source "$(dirname "$0")/gpu_common.sh"
# sweep FILE SECONDS SETTING...: norm_sweep.sh's table into $OUT/FILE (SWEEP_* from the caller's
# environment), its ms rows printed, its per-setting folders removed.
sweep() {
  local file=$1 seconds=$2
  shift 2
  timeout "$seconds" bash scripts/norm_sweep.sh "$@" > "$OUT/$file" 2>&1
  grep " ms " "$OUT/$file"
  rm -rf "$OUT/sweep"
}
# sweep_ab FILE SECONDS A B: settings A and B twice each, alternating (A B A B), so that a drift
# of the machine during the stage shows as a difference between the two runs of one setting.
sweep_ab() {
  sweep "$1" "$2" "$3" "$4" "$3" "$4"
}
if [ -n "${BASE:-}" ]; then
  BASE=$(cd "$BASE" && pwd) || { echo "BASE: no such folder"; exit 1; }
  # Its own kernel cache: the cache's per-kernel lock would queue the two compiles. CACHE_IN may
  # hold its kernels too (the base an earlier run's tree).
  mkdir -p /tmp/apex-cache-base
  [ -n "${CACHE_IN:-}" ] && [ -f "$CACHE_IN" ] && tar xzf "$CACHE_IN" -C /tmp/apex-cache-base
  (APEX_CACHE_DIR=/tmp/apex-cache-base PYTHONPATH=$(sources_of "$BASE") timeout 400 python3 -c \
    "import torch; from apex.normalization import FusedRMSNorm; m = FusedRMSNorm(8).cuda(); m(torch.ones(2, 8, device='cuda'))" \
    > "$OUT/base_compile.log" 2>&1; echo "base compile rc=$?" >> "$OUT/base_compile.log") &
fi
if [ "${NO_TESTS:-0}" = 1 ]; then
  compile_only
else
  cuda_tests "${TEST_DIRS:-packages/apex-norm/tests=240}"
fi
if [ "${FWD_SWEEP:-0}" = 1 ]; then
  # The forward's shapes (2026-12-04): both norms through fwd_fast_r80 (fwd_r80=3) or RMSNorm
  # through fwd_fast's LEAN variant (1), LayerNorm bf16 at 2 and 4 vectors a thread without the
  # 80-register cap; float32 at 4 vectors a thread (the old default) against 2. fwd_mid_pt16=0 in
  # each: since 20:2x it overrides fwd_pt16 at 2048 < H <= 4096.
  SWEEP_PASSES=fwd SWEEP_H=1024,2048,4096,8192,16384 sweep sweep_fwd.txt 240 "fwd_r80=3,fwd_mid_pt16=0" \
    "fwd_r80=1,fwd_mid_pt16=0" "fwd_pt16=4,fwd_r80=0,fwd_mid_pt16=0" "fwd_pt16=2,fwd_r80=0,fwd_mid_pt16=0" \
    "fwd_r80=3,rms_short_pt16=0,fwd_mid_pt16=0" "fwd_r80=3,fwd_mid_pt16=0"
  SWEEP_DT=fp32 SWEEP_H=1024,4096,16384 sweep sweep_fwd32.txt 100 "fwd_pt=4" "fwd_pt=2"
fi
if [ "${BWD_SWEEP:-0}" = 1 ]; then
  # The backward's 80-register ring per norm (bwd_r80: 1 LayerNorm, 2 RMSNorm) and 4-vector rows
  # at H <= 4096 (bwd_pt16=4; above 4096 rows are at 4 already, bwd_wide_pt16). Asked again at
  # 18:0x because the ring read in both passes (c132a76) has fewer registers (RMSNorm's LEAN
  # ring 58 uncapped); 16:04 and 16:15 asked with knobs since folded away (bwd_min_rows; NOTES).
  SWEEP_PASSES=fwd+bwd SWEEP_H=1024,2048,4096,8192 sweep sweep_bwd.txt 300 \
    "bwd_r80=3" "bwd_r80=1" "bwd_r80=0" "bwd_pt16=4" "bwd_r80=3"
fi
if [ "${NCU:-0}" = 1 ]; then
  # Nsight Compute on the 16-bit forward and ring backward kernels of both norms at H = 4096 (NCU_H)
  # (one launch each; hardware counters where the machine's runtime lets ncu read them).
  timeout 240 ncu --clock-control none -k regex:"${NCU_K:-fwd_fast|bwd_ring}" --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats python3 scripts/ncu_norm_driver.py "${NCU_H:-4096}" > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "fwd_fast|bwd_ring|Throughput|Duration|Stall|Achieved Occupancy|Registers|Eligible|Issued Warp|One or More|No Eligible|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit" "$OUT/ncu.txt" | cut -c1-150
fi
if [ "${BWD_LEAN:-0}" = 1 ]; then
  # The ring backward's LEAN variant (weight, bias and grad_input in the input's dtype) against
  # the general one (both with RMSNorm's one-value group sums). At 16:25 UTC this ran as
  # `SWEEP_PASSES=fwd+bwd SWEEP_H=2048,4096 norm_sweep.sh bwd_lean=1 bwd_lean=0`, one run each.
  # At 18:1x it ran at H = 4096-16384 on daf03a5, whose LEAN ring also took the 4-vector rows
  # (H > 4096); slower there but for RMSNorm's rows of 512 threads, so reverted (NOTES.md).
  SWEEP_PASSES=fwd+bwd SWEEP_H=1024,2048,4096 sweep_ab sweep_lean.txt 150 "bwd_lean=1" "bwd_lean=0"
fi
if [ "${HINT_SWEEP:-0}" = 1 ]; then
  # The 16-bit forward's cache hints (fwd_hint for LayerNorm, rms_fwd_hint for RMSNorm). At
  # 12-05 03:4x: none, the input's loads past L1 (1), also weight and bias at L1::evict_last (3),
  # also the output streamed (7), for both norms (then one knob). Now: the defaults (LayerNorm
  # 7, RMSNorm none) against the streaming store alone (4) for both; twice each, alternating.
  SWEEP_PASSES=fwd SWEEP_H=1024,2048,4096,8192,16384 sweep_ab sweep_hint.txt 240 \
    "fwd_hint=7,rms_fwd_hint=0" "fwd_hint=4,rms_fwd_hint=4"
fi
if [ "${RING4_SWEEP:-0}" = 1 ]; then
  # LayerNorm's 16-bit 4-vector ring (H > 4096): bias sums as float4s or floats (bwd_bias4),
  # twice each, alternating. (Its LEAN variant, knob bwd_lean4, ran here at 12-05 03:4x: slower.)
  SWEEP_PASSES=fwd+bwd SWEEP_H=8192,12288,16384 SWEEP_NORMS=layernorm sweep_ab sweep_ring4.txt 200 \
    "bwd_bias4=1" "bwd_bias4=0"
fi
if [ "${WIDE_SWEEP:-0}" = 1 ]; then
  SWEEP_DT=bf16 SWEEP_PASSES=fwd+bwd SWEEP_H=2048,4096,8192,12288,16384 SWEEP_NORMS=layernorm \
    sweep_ab sweep_wide.txt 180 "bwd_wide=0" "bwd_wide=3"
fi
if [ -n "${SWEEP_SETTINGS:-}" ]; then
  # shellcheck disable=SC2086  # one word per setting
  sweep sweep_settings.txt "${SWEEP_SECONDS:-300}" $SWEEP_SETTINGS
fi
if [ "${SHAPES:-0}" = 1 ]; then
  timeout 240 python3 scripts/norm_kernel_shapes.py > "$OUT/shapes.txt" 2>&1
  grep " us " "$OUT/shapes.txt" | cut -c1-200
fi
if [ "${HOST:-0}" = 1 ]; then
  timeout 60 python3 scripts/host_norm.py 1024 > "$OUT/host_norm.txt" 2>&1
  head -16 "$OUT/host_norm.txt"
fi
if [ "${WALL:-0}" = 1 ]; then
  timeout 150 python3 scripts/wall_trace_norm.py 1024 > "$OUT/wall_trace.txt" 2>&1
  grep -E "wall/device|: step" "$OUT/wall_trace.txt"
fi
if [ "${HOST_BIG:-0}" = 1 ]; then
  timeout 120 python3 scripts/host_big_norm.py 1024 > "$OUT/host_big.txt" 2>&1
  grep -E "^rows|^H=" "$OUT/host_big.txt"
fi
if [ "${FLOOR:-0}" = 1 ]; then
  timeout 150 python3 scripts/wall_floor_norm.py 1024 > "$OUT/wall_floor.txt" 2>&1
  grep -E "^(floor|module|apex|torch)|Error" "$OUT/wall_floor.txt"
fi
if [ -n "${BASE:-}" ]; then
  wait
  tail -1 "$OUT/base_compile.log"
  # ab TREE LABEL I: TREE's norm_sweep.sh into $OUT/ab_I_LABEL.txt ('=' and ',' as '_': the
  # device's copy-back drops such names). The label is the sweep's setting: "base" and "new"
  # hold no '=', so APEX_NORM_TUNE leaves every knob at its default; AB_NEW's knobs apply.
  ab() {
    SWEEP_PASSES=${AB_PASSES:-fwd,fwd+bwd} SWEEP_H=1024,2048,4096,8192,16384 timeout 120 \
      bash "$1/scripts/norm_sweep.sh" "$2" > "$OUT/ab_${3}_${2//[=,]/_}.txt" 2>&1
  }
  for i in 1 2; do
    APEX_CACHE_DIR=/tmp/apex-cache-base ab "$BASE" base "$i"
    ab "$ROOT" "${AB_NEW:-new}" "$i"
  done
  grep -h " ms " "$OUT"/ab_*.txt | sort -b -k2,2 -k3,3 -s
  rm -rf "$OUT/sweep"
fi
if [ "${BENCH:-0}" = each ]; then
  # One bench_norm run per case (each with its own copy bandwidth and competitors), the rows of
  # record first, so that a call cut short by DEADLINE (seconds since the script began) keeps
  # what finished: bf16 H = 4096 / 8192 / 16384 / 2048 / 1024, then fp32 H=4096.
  B="$OUT/bench"
  # shellcheck disable=SC2086  # one word per case
  for c in ${BENCH_CASES:-bf16:4096 bf16:8192 bf16:16384 bf16:2048 bf16:1024 fp32:4096}; do
    left=$(( ${DEADLINE:-100000} - SECONDS ))
    [ "$left" -gt 20 ] || { echo "bench: no time left for $c"; break; }
    mkdir -p "$B/${c/:/_}"
    timeout "$left" python3 packages/apex-norm/benchmarks/bench_norm.py --out "$B/${c/:/_}" \
      --dtypes "${c%%:*}" --hidden "${c##*:}" > "$B/${c/:/_}/norm.log" 2>&1 || echo "bench $c: rc=$?"
    grep -hE "^\| (rms|layer)norm" "$B/${c/:/_}/bench_norm.md" 2>/dev/null |
      awk -F'|' '{printf "%-44s %-8s %8s %7s %7s\n", $3, $4, $5, $8, $13}'
  done
  tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$B"
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
