#!/usr/bin/env bash
# Deferred RMSNorm (models/llama.py) on the GPU, in one device call per group of sections:
#   bash benchmarks/deferred_norm_gpu.sh SECTION...   (tests, correctness, ab, ab_fp8, prompt, profile)
# tests: the kernel and CUDA-graph tests the change touches; correctness: gpu_e2e's GPU-vs-CPU float32 check;
# ab / ab_fp8: the DESIGN workload with NV_DEFERRED_NORM=0 / 1 / decode in turn (one process each, two rounds);
# prompt: a prompt-heavy job, engine alone, off / on / decode in turn (MODES="decode 1" picks others);
# ab_steps: the DESIGN workload with deferral at decode steps and at every step (the default), in turn, two rounds
# (FP8=1: the fp8 cache too);
# prefill: the prompt steps' kernel tables, deferred at decode steps and at every step; profile: a timeline of decode steps, on.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
for section in "$@"; do
  echo "=== $section"
  case $section in
    tests)
      python3 -m pytest -q -x tests/kernels/test_fused_layers.py tests/kernels/test_attention_kernels.py \
        tests/kernels/test_rms_norm.py tests/engine/test_cuda_graphs.py tests/engine/test_model_runner.py 2>&1 | tail -4 ;;
    correctness)
      python3 benchmarks/gpu_e2e.py --sections correctness 2>&1 | grep "^## " ;;
    ab)
      bash benchmarks/ab_gpu.sh throughput 3 "off:NV_DEFERRED_NORM=0" "on:NV_DEFERRED_NORM=1" \
        "decode:NV_DEFERRED_NORM=decode" "off2:NV_DEFERRED_NORM=0" "on2:NV_DEFERRED_NORM=1" ;;
    ab_fp8)
      bash benchmarks/ab_gpu.sh fp8 3 "off:NV_DEFERRED_NORM=0" "on:NV_DEFERRED_NORM=1" \
        "off2:NV_DEFERRED_NORM=0" "on2:NV_DEFERRED_NORM=1" ;;
    prompt)
      for round in 1 2; do
        for mode in ${MODES:-0 1 decode}; do
          echo "[prompt-heavy NV_DEFERRED_NORM=$mode round $round]"
          NV_DEFERRED_NORM=$mode python3 benchmarks/prompt_heavy.py --kinds engine --lines 2048 --max-tokens 16 \
            --repeats 1 2>&1 | tail -3
        done
      done ;;
    ab_steps)
      bash benchmarks/ab_gpu.sh throughput${FP8:+,fp8} 3 "decode:NV_DEFERRED_NORM=decode" "every:" \
        "decode2:NV_DEFERRED_NORM=decode" "every2:" ;;
    prefill)
      for mode in decode 1; do
        echo "[prefill NV_DEFERRED_NORM=$mode]"
        NV_DEFERRED_NORM=$mode python3 benchmarks/profile_gpu.py --sections prefill 2>&1 | grep -v Warning | tail -17
      done ;;
    profile)
      python3 benchmarks/profile_gpu.py --sections steps --batches 48:1500,128:1000,256:800 2>&1 | tail -30 ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
