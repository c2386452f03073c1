#!/usr/bin/env bash
# fp8 KV pages, dims-major V with 32-token pages (kernels/kv_layout.py), checked and timed in one device call:
#   bash benchmarks/fp8_layout_gpu.sh BASE_TREE   (BASE_TREE: `git archive` of the commit before the change)
# 1. the kernel tests (layouts, attention, stores, fused rotary) and the CUDA-graph tests on the GPU;
# 2. the layouts side by side, decode and prefill kernels (decode_variants.py --layouts);
# 3. the end-to-end workload, base tree then this one (tree_ab_gpu.sh, throughput and fp8, median of 2).
set -u
export PYTHONUNBUFFERED=1
python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kv_layout.py tests/kernels/test_attention_kernels.py \
  tests/kernels/test_kv_store.py tests/kernels/test_fused_layers.py tests/engine/test_cuda_graphs.py 2>&1 | tail -4
python3 benchmarks/decode_variants.py --layouts 2>&1 | tail -22
bash benchmarks/tree_ab_gpu.sh "$1" throughput,fp8 2 1
