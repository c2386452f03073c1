#!/usr/bin/env bash
# Prefill attention reading the step's own K/V rows (RESULTS session 19), on one GPU. Steps (all by default):
#   tests        the attention, fused-layer, model-runner and CUDA-graph tests on the GPU
#   probe        benchmarks/prefill_gpu.py --sweep: the kernel at prompt-step shapes, paged vs step rows vs FA2
#   correctness  gpu_e2e.py --sections correctness (GPU float32 = CPU float32 end to end)
#   ab           end to end, NV_PREFILL_STEP_KV=0 (off) and 1 (on) in turn, ROUNDS rounds (default 2): a
#                prompt-heavy job (4,096 lines x 1,000 prompt tokens, 1 output token, token ids) and the DESIGN
#                workload (gpu_e2e.py --sections throughput --repeats 3)
# e.g. bash benchmarks/prefill_step_kv_gpu.sh tests probe;  ROUNDS=3 bash benchmarks/prefill_step_kv_gpu.sh ab
# Full logs go to $OUT, summaries to stdout (the last lines).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
steps=${*:-tests probe correctness ab}
summary=()
run() { local name=$1; shift; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; echo "[$name] exit $? in $((SECONDS - t0)) s"; }
for s in $steps; do
  case $s in
    tests) run $s timeout 400 python3 -m pytest -q -x tests/kernels/test_attention_kernels.py \
             tests/kernels/test_fused_layers.py tests/engine/test_model_runner.py tests/engine/test_cuda_graphs.py
           tail -3 "$OUT/$s.log" ;;
    probe) run $s timeout 400 python3 benchmarks/prefill_gpu.py --sweep; grep "^| " "$OUT/$s.log" | sort -u ;;
    correctness) run $s timeout 200 python3 benchmarks/gpu_e2e.py --sections correctness; grep "^## " "$OUT/$s.log" ;;
    ab) for round in $(seq 1 "${ROUNDS:-2}"); do
          for v in 0 1; do
            run heavy_${v}_$round env NV_PREFILL_STEP_KV=$v timeout 200 python3 benchmarks/prompt_heavy.py \
              --lines 4096 --repeats 1 --max-tokens 1 --kinds ids
            while IFS= read -r line; do summary+=("step_kv=$v round $round | heavy | $line"); done \
              < <(grep "^ids:" "$OUT/heavy_${v}_$round.log")
            run e2e_${v}_$round env NV_PREFILL_STEP_KV=$v timeout 200 python3 benchmarks/gpu_e2e.py \
              --sections throughput --repeats 3
            while IFS= read -r line; do summary+=("step_kv=$v round $round | e2e | ${line#\#\# }"); done \
              < <(grep "^## " "$OUT/e2e_${v}_$round.log" | grep -v "device:")
          done
        done ;;
  esac
done
printf '%s\n' "${summary[@]}"
