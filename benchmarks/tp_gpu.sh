#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine within a short device budget:
# correctness (eager, then CUDA graphs) with stack dumps if anything hangs, then a reduced bench.
set -u
export PYTHONUNBUFFERED=1
timeout 130 python3 benchmarks/tp_gpu.py --tp 2 --skip-bench --eager --stacks-after 115 2>&1 | grep -v "Warning\|regex\|shards"
timeout 100 python3 benchmarks/tp_gpu.py --tp 2 --skip-bench --stacks-after 90 2>&1 | grep -v "Warning\|regex\|shards"
graphs_ok=$?
for tp in 1 2; do
  timeout 75 python3 -m nvcli bench --model qwen3-8b --load-format dummy --tp $tp --num-prompts 128 \
    --output-len 100-512 --quiet --output-json ${OUT:-/tmp}/tp$tp.json 2>&1 | grep -v "Warning\|regex" | tail -4
done
