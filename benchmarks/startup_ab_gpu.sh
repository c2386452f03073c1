#!/usr/bin/env bash
# Cold start-ups of two source trees side by side, in one device call:
#   bash benchmarks/startup_ab_gpu.sh BASE_TREE ROUNDS ["LABEL:VAR=VAL ..." ...]
# e.g. bash benchmarks/startup_ab_gpu.sh .baseline 3 "w16:NV_COMPILE_WORKERS=16" "w12:NV_COMPILE_WORKERS=12"
# (.baseline: `git archive <commit>` of the base). Each round runs benchmarks/startup.py on an empty Triton cache
# from the base tree, then from this one under each variant's variables (default: one variant, "new:"), so machine
# drift hits all alike. STARTUP_VERBOSE=1 prints compile-ahead's timeline in this tree's runs. Then the warm
# start-ups: WARM_ROUNDS (default 1) rounds of the base and this tree in turn, each on the cache its own last cold run
# filled. Site-packages are byte-compiled first, as a user's install is (explore_gpu.sh's startup step).
set -u
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
base=$(cd "$1" && pwd); rounds=$2; shift 2
variants=("$@"); [ ${#variants[@]} -eq 0 ] && variants=("new:")
timeout 150 python3 -m compileall -q -j 16 $(python3 -c "import sys; print(' '.join(p for p in sys.path if 'packages' in p))") \
  /tmp/site > /dev/null 2>&1
show() { grep "^##\|model runner\|compiled .* ahead\|_kernel: submitted\|loaded in" | grep -v "Warning"; }
verbose=$([ "${STARTUP_VERBOSE:-0}" = 1 ] && echo --verbose)
cache=""; base_cache=""
for round in $(seq 1 "$rounds"); do
  base_cache=$(mktemp -d); echo "-- base round $round"
  (cd "$base" && PYTHONPATH="$base:${PYTHONPATH:-}" TRITON_CACHE_DIR=$base_cache timeout 150 python3 \
    benchmarks/startup.py 2>&1) | show
  for variant in "${variants[@]}"; do
    cache=$(mktemp -d); echo "-- ${variant%%:*} round $round"
    env ${variant#*:} TRITON_CACHE_DIR=$cache timeout 150 python3 benchmarks/startup.py $verbose 2>&1 | show
  done
done
for round in $(seq 1 "${WARM_ROUNDS:-1}"); do
  echo "-- base, warm, round $round"
  (cd "$base" && PYTHONPATH="$base:${PYTHONPATH:-}" TRITON_CACHE_DIR=$base_cache timeout 150 python3 \
    benchmarks/startup.py 2>&1) | show
  echo "-- this tree, warm, round $round (the last run's cache)"
  TRITON_CACHE_DIR=$cache timeout 150 python3 benchmarks/startup.py 2>&1 | show
done
