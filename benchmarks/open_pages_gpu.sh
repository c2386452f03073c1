#!/usr/bin/env bash
# Open fp8 V pages (kv_layout.py: a sequence's partial last page keeps V token-major until sealed) against
# BASE_TREE (`git archive` of a commit whose fp8 V pages are dims-major from the first token), in one device call:
#   bash benchmarks/open_pages_gpu.sh BASE_TREE [E2E_ROUNDS]
# 1. the kernel tests on the GPU (layouts, attention, stores, fused rotary, CUDA graphs);
# 2. the engine's fp8 decode kernel at the workload's shapes (rope_store_gpu.py's fp8 half: without the rotary
#    step, with it, with it but no stores, with the stores sent to an unread page), base and this tree in turn,
#    two processes each;
# 3. end to end fp8 (gpu_e2e.py, median of 3 runs), base and this tree in turn, a fresh process each, E2E_ROUNDS
#    rounds (default 3).
# Logs go to $OUT; the summary is printed last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
base=$(cd "$1" && pwd); rounds=${2:-3}
here=$PWD
summary=()
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kv_layout.py \
  tests/kernels/test_attention_kernels.py tests/kernels/test_kv_store.py tests/kernels/test_fused_layers.py \
  tests/engine/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
summary+=("kernel and graph tests (exit $?): $(grep -E "passed|failed|error" "$OUT/tests.log" | tail -1)")

in_tree() {  # in_tree base|new CMD...: CMD run from that tree's root with that tree on the path
  local tree=$here; [ "$1" = base ] && tree=$base; shift
  (cd "$tree" && PYTHONPATH="$tree:$tree/benchmarks:${PYTHONPATH:-}" "$@")
}
kernel_py="import torch, rope_store_gpu as r; from nvcli.models.layers.rotary import RotaryEmbedding as R
r.fp8_rows(R(128, 4096, 1e6, None).cos_sin_cache.to('cuda'), torch.ones(128, device='cuda', dtype=torch.bfloat16))"
for round in 1 2; do
  for tree in base new; do
    log="$OUT/kernel_${tree}_$round.log"
    in_tree "$tree" bash -c "cd benchmarks && python3 -c \"$kernel_py\"" > "$log" 2>&1
    while IFS= read -r line; do summary+=("$tree $round | $line"); done < <(grep -E ": .* us" "$log")
    grep -q " us" "$log" || summary+=("$tree $round | FAILED: $(tail -1 "$log")")
  done
done
for round in $(seq 1 "$rounds"); do
  for tree in base new; do
    log="$OUT/e2e_${tree}_$round.log"
    in_tree "$tree" timeout 200 python3 benchmarks/gpu_e2e.py --sections fp8 --repeats 3 > "$log" 2>&1
    summary+=("$tree e2e $round | $(grep '^## throughput' "$log" || tail -1 "$log")")
  done
done
printf '%s\n' "${summary[@]}" | sort -s -t'|' -k2,2
