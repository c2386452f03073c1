#!/usr/bin/env bash
# Side by side of two source trees on the end-to-end benchmarks, in one device call:
#   bash benchmarks/tree_ab_gpu.sh BASE_TREE SECTIONS REPEATS ROUNDS
# e.g. bash benchmarks/tree_ab_gpu.sh .baseline latency 3 2   (.baseline: `git archive <commit>` of the base)
# Each round runs benchmarks/gpu_e2e.py --sections SECTIONS in a fresh process from the base tree, then from
# this one, so machine drift hits both alike; the result rows are printed together at the end.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
base=$(cd "$1" && pwd); sections=$2; repeats=$3; rounds=$4
here=$PWD
summary=()
for round in $(seq 1 "$rounds"); do
  for tree in "$base" "$here"; do
    label=$([ "$tree" = "$here" ] && echo new || echo base)
    log="$OUT/tree_ab_${label}_$round.log"
    t0=$SECONDS
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" python3 benchmarks/gpu_e2e.py --sections "$sections" \
      --repeats "$repeats") > "$log" 2>&1
    echo "[$label round $round] exit $? in $((SECONDS - t0)) s"
    while IFS= read -r line; do summary+=("$label $round | ${line#\#\# }"); done < <(grep "^## " "$log" | grep -v "device:")
  done
done
printf '%s\n' "${summary[@]}"
