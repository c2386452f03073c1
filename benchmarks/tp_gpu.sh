#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine in one device call (about 7 minutes):
# correctness (eager, then CUDA graphs, each with stack dumps if anything hangs), then `nv bench`
# on dummy Qwen3-8B weights with the full DESIGN.md workload (median of 2 after a warm-up) at TP=1 and TP=2.
set -u
export PYTHONUNBUFFERED=1
timeout 130 python3 benchmarks/tp_gpu.py --tp 2 --skip-bench --eager --stacks-after 115 2>&1 | grep -v "Warning\|regex\|shards"
timeout 130 python3 benchmarks/tp_gpu.py --tp 2 --skip-bench --stacks-after 115 2>&1 | grep -v "Warning\|regex\|shards"
echo "graph-mode correctness exit: ${PIPESTATUS[0]}"
for tp in 1 2; do
  /usr/bin/time -f "tp=$tp process wall %e s" timeout 170 python3 -m nvcli bench --model qwen3-8b --load-format dummy \
    --tp $tp --repeats 2 --quiet --output-json ${OUT:-/tmp}/tp$tp.json 2>&1 | grep -v "Warning\|regex" | tail -5
  echo "tp=$tp exit: ${PIPESTATUS[0]}"
done
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp")
d = {tp: json.load(open(f"{out}/tp{tp}.json")) for tp in (1, 2) if os.path.exists(f"{out}/tp{tp}.json")}
for tp, r in d.items():
    print(f"| TP={tp} | {r['output_tokens_per_second']:,.0f} output tok/s | {r['elapsed_time']:.2f} s "
          f"| runs {[round(t, 2) for t in r.get('all_elapsed_times', [])]} | start-up {r.get('startup_s', 0):.1f} s "
          f"| {r.get('kv_blocks')} KV blocks |")
if len(d) == 2:
    print(f"scaling TP=2 / TP=1: {d[2]['output_tokens_per_second'] / d[1]['output_tokens_per_second']:.2f}x")
PY
