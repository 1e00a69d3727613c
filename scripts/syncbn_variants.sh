#!/usr/bin/env bash
# A/B of apex-parallel kernel variants in one GPU call (2026-12-04): each variant is a copy of
# the package sources with another csrc/welford.cu, compiled side by side (own kernel cache),
# then timed by `scripts/profile_gpu.py syncbn` (each kernel's time) in turn, twice, alternating.
#   OUT=dir bash scripts/syncbn_variants.sh name=path/to/welford.cu [name=...]
# The working tree's own sources are the variant "tree".
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
names=(tree)
declare -A path=([tree]="$ROOT/packages/apex-parallel/src/apex/parallel/csrc/welford.cu")
for arg in "$@"; do
  [ "${arg%%=*}" = tree ] && { echo "syncbn_variants: 'tree' is the working tree's own variant" >&2; exit 2; }
  names+=("${arg%%=*}")
  path[${arg%%=*}]=$(realpath "${arg#*=}")
done
pp() {  # the PYTHONPATH of a variant
  local v=/tmp/variant-$1
  echo "$(ls -d "$ROOT"/packages/*/src | grep -v apex-parallel | paste -sd:):$v/src"
}
for n in "${names[@]}"; do
  v=/tmp/variant-$n
  rm -rf "$v" && mkdir -p "$v" && cp -r "$ROOT/packages/apex-parallel/src" "$v/"
  cp "${path[$n]}" "$v/src/apex/parallel/csrc/welford.cu"
  (APEX_CACHE_DIR=/tmp/cache-$n MAX_JOBS=4 PYTHONPATH=$(pp "$n") timeout 300 python3 -c \
    "import torch; from apex.parallel import ops; ops.syncbn_stats(torch.randn(4, 8, 3, device='cuda'))" \
    > "$OUT/compile-$n.log" 2>&1; echo "compiled $n rc=$?") &
done
wait
for round in 1 2; do
  for n in "${names[@]}"; do
    echo "== $n (round $round)"
    APEX_CACHE_DIR=/tmp/cache-$n PYTHONPATH=$(pp "$n") timeout 120 python3 "$ROOT/scripts/profile_gpu.py" syncbn 2>&1 |
      grep -v -e UserWarning -e _warn_once | tee "$OUT/prof-$n-$round.txt" | grep -E "^syncbn|device time|stats_|reduce_|fused_elem" | cut -c1-120
  done
done
