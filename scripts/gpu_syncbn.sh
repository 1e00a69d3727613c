#!/usr/bin/env bash
# One GPU call for apex-parallel (2026-12-04): compile, its `cuda` tests, bench_syncbn
# (SyncBatchNorm and DDP) and the syncbn kernel profile (scripts/profile_gpu.py syncbn: each
# kernel's time). Everything under $OUT (bench.tgz holds the benchmark tables).
#   CACHE_IN=.gl/cache.tgz OUT=dir bash scripts/gpu_syncbn.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests "packages/apex-parallel/tests=240"
B="$OUT/bench"
mkdir -p "$B"
timeout 120 python3 packages/apex-parallel/benchmarks/bench_syncbn.py --out "$B" > "$B/syncbn.log" 2>&1 ||
  echo "bench_syncbn: rc=$? (see bench/syncbn.log in bench.tgz)"
grep -E "^\| (syncbn|ddp)" "$B/bench_syncbn.md" | awk -F'|' '{printf "%-44s %-34s %7s %6s %7s %7s %7s\n", $3, $4, $5, $8, $9, $12, $13}'
timeout 90 python3 scripts/profile_gpu.py syncbn 2>&1 | grep -v -e UserWarning -e _warn_once > "$OUT/prof_syncbn.txt"
cut -c1-140 "$OUT/prof_syncbn.txt"
tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$B"
echo "== done $(date -u +%FT%TZ)"
