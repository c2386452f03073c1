#!/usr/bin/env bash
# Open fp8 V pages (kv_layout.py), the open page read after the tile loop (NV_DECODE_OPEN_TAIL=1, the default)
# or as a tile before it (=0), against BASE_TREE (`git archive` of main, whose fp8 V pages are dims-major from
# the first token), in one device call:
#   bash benchmarks/open_pages_gpu.sh BASE_TREE [E2E_ROUNDS]
# 1. the kernel tests on the GPU (layouts, attention, stores, fused rotary, CUDA graphs), both open-page reads;
# 2. the engine's fp8 decode kernel at the workload's shapes (rope_store_gpu.py's fp8 half), the three in turn,
#    two processes each;
# 3. end to end fp8, base tree then this one, E2E_ROUNDS rounds (tree_ab_gpu.sh, median of 3 runs each).
set -u
export PYTHONUNBUFFERED=1
base=$(cd "$1" && pwd); rounds=${2:-1}
tests="tests/kernels/test_kv_layout.py tests/kernels/test_attention_kernels.py tests/kernels/test_kv_store.py"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider $tests tests/kernels/test_fused_layers.py \
  tests/engine/test_cuda_graphs.py 2>&1 | tail -2
NV_DECODE_OPEN_TAIL=0 timeout 200 python3 -m pytest -q -x -p no:cacheprovider $tests 2>&1 | tail -2
kernel=()
for round in 1 2; do
  for variant in base tail first; do
    case $variant in
      base) out=$(cd "$base/benchmarks" && PYTHONPATH="$base:$base/benchmarks:${PYTHONPATH:-}" python3 -c \
        "import torch, rope_store_gpu as r; from nvcli.models.layers.rotary import RotaryEmbedding as R
r.fp8_rows(R(128, 4096, 1e6, None).cos_sin_cache.to('cuda'), torch.ones(128, device='cuda', dtype=torch.bfloat16))" 2>&1) ;;
      tail) out=$(cd benchmarks && PYTHONPATH="$PWD/..:$PWD:${PYTHONPATH:-}" python3 rope_store_gpu.py --fp8 2>&1) ;;
      first) out=$(cd benchmarks && NV_DECODE_OPEN_TAIL=0 PYTHONPATH="$PWD/..:$PWD:${PYTHONPATH:-}" \
        python3 rope_store_gpu.py --fp8 2>&1) ;;
    esac
    while IFS= read -r line; do kernel+=("$variant $round | $line"); done < <(grep ": .* us" <<< "$out")
    grep -q " us" <<< "$out" || tail -5 <<< "$out"
  done
done
bash benchmarks/tree_ab_gpu.sh "$base" fp8 3 "$rounds"
printf '%s\n' "${kernel[@]}" | sort -t'|' -k2,2 -s
