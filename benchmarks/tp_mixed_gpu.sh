#!/usr/bin/env bash
# Tensor parallelism with the mixed graphs (steps that carry prompt chunks beside running decodes), on a 2-GPU machine
# in one device call (about 8 minutes):
# 1. correctness: tp_gpu.py's greedy TP=2 vs TP=1 checks eager (split steps without graphs) and with CUDA graphs
#    (adds a streaming float32 case whose steps replay mixed graphs on both ranks);
# 2. a streaming job at TP=2 on dummy Qwen3-8B weights (512 requests through 128 slots, outputs 100-400, token budget
#    8,192, median of 2 after a warm-up): mixed graphs (default) and one prefill kernel for every row
#    (NV_SPLIT_MIXED=0), each in its own process, in turn.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
filter() { grep -v "Warning\|regex\|shards"; }
timeout 100 python3 benchmarks/tp_gpu.py --tp 2 --skip-bench --eager --stacks-after 95 2>&1 | filter | grep "^## \|Error\|error"
echo "eager correctness exit: ${PIPESTATUS[0]}"
timeout 200 python3 benchmarks/tp_gpu.py --tp 2 --skip-bench --stacks-after 195 2>&1 | filter | grep "^## \|Error\|error"
echo "graph-mode correctness exit: ${PIPESTATUS[0]}"
for mode in "mixed-graphs:" "unsplit:NV_SPLIT_MIXED=0"; do
  label=${mode%%:*}
  env ${mode#*:} timeout 150 python3 -m nvcli bench --model qwen3-8b --load-format dummy --tp 2 --num-prompts 512 \
    --output-len 100-400 --max-num-seqs 128 --max-num-batched-tokens 8192 --repeats 2 --quiet \
    --output-json "$OUT/stream_$label.json" > "$OUT/stream_$label.log" 2>&1
  echo "[$label] exit $?"; filter < "$OUT/stream_$label.log" | tail -3
done
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp")
print("| TP=2 streaming, qwen3-8b dummy | output tok/s (median of 2) | runs (s) | start-up |\n| --- | --- | --- | --- |")
for label in ("mixed-graphs", "unsplit"):
    path = f"{out}/stream_{label}.json"
    if os.path.exists(path):
        r = json.load(open(path))
        print(f"| {label} | {r['output_tokens_per_second']:,.0f} | {[round(t, 2) for t in r['all_elapsed_times']]} "
              f"| {r['startup_s']:.1f} s |")
PY
