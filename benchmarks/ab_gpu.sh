#!/usr/bin/env bash
# Side-by-side A/B of environment switches on the end-to-end benchmarks, in one device call:
#   bash benchmarks/ab_gpu.sh SECTIONS REPEATS "LABEL:VAR=VAL VAR=VAL" "LABEL:..." ...
# e.g. bash benchmarks/ab_gpu.sh throughput,fp8 2 "base:" "two-stream:NV_TWO_STREAM_MIN_BATCH=64"
# Each variant runs benchmarks/gpu_e2e.py --sections SECTIONS in its own process with those variables;
# the result rows of every variant are printed together at the end. Logs go to $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
sections=$1; repeats=$2; shift 2
summary=()
for variant in "$@"; do
  label=${variant%%:*}; vars=${variant#*:}
  t0=$SECONDS
  env $vars python3 benchmarks/gpu_e2e.py --sections "$sections" --repeats "$repeats" > "$OUT/ab_$label.log" 2>&1
  rc=$?
  echo "[$label] ($vars) exit $rc in $((SECONDS - t0)) s"
  while IFS= read -r line; do summary+=("$label | ${line#\#\# }"); done < <(grep "^## " "$OUT/ab_$label.log" | grep -v "device:")
done
printf '%s\n' "${summary[@]}"
