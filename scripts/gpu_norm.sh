#!/usr/bin/env bash
# One GPU call for apex-norm (2026-12-04): compile, the `cuda` tests of apex-norm, then, each
# when asked: SWEEP=1 the forward's register caps and fixed-dtype kernels (APEX_NORM_TUNE fwd_r80)
# and the backward's vectors per thread at H=1024; HOST=1 the host cost per eager call
# (scripts/host_norm.py); BENCH=1 bench_norm (bf16 every H, fp32 H=4096; ours, torch eager,
# torch.compile). Everything under $OUT (bench.tgz holds the benchmark tables).
#   CACHE_IN=.gl/cache.tgz HOST=1 BENCH=1 OUT=dir bash scripts/gpu_norm.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests "packages/apex-norm/tests=240"
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
