#!/usr/bin/env bash
# Open fp8 V pages (kv_layout.py), the open page read after the tile loop (NV_DECODE_OPEN_TAIL=1, the default)
# or as a tile before it (=0), against BASE_TREE (`git archive` of main, whose fp8 V pages are dims-major from
# the first token), in one device call:
#   bash benchmarks/open_pages_gpu.sh BASE_TREE [E2E_ROUNDS] [E2E_VARIANTS]
# 1. the kernel tests on the GPU (layouts, attention, stores, fused rotary, CUDA graphs), both open-page reads;
# 2. the engine's fp8 decode kernel at the workload's shapes (rope_store_gpu.py's fp8 half: without and with the
#    rotary step), base / tail / first in turn, two processes each;
# 3. end to end fp8 (gpu_e2e.py, median of 3 runs), each of E2E_VARIANTS (default "base tail") in turn, in a
#    fresh process each, E2E_ROUNDS rounds (default 1).
# Logs go to $OUT; the summary is printed last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
base=$(cd "$1" && pwd); rounds=${2:-1}; e2e_variants=${3:-base tail}
here=$PWD
summary=()
tests="tests/kernels/test_kv_layout.py tests/kernels/test_attention_kernels.py tests/kernels/test_kv_store.py"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider $tests tests/kernels/test_fused_layers.py \
  tests/engine/test_cuda_graphs.py > "$OUT/tests_tail.log" 2>&1
summary+=("tests, tail: $(tail -1 "$OUT/tests_tail.log")")
NV_DECODE_OPEN_TAIL=0 timeout 200 python3 -m pytest -q -x -p no:cacheprovider $tests > "$OUT/tests_first.log" 2>&1
summary+=("tests, first: $(tail -1 "$OUT/tests_first.log")")

# run VARIANT CMD...: CMD in the variant's tree and environment
in_variant() {
  local variant=$1; shift
  case $variant in
    base) (cd "$base" && PYTHONPATH="$base:$base/benchmarks:${PYTHONPATH:-}" "$@") ;;
    tail) (PYTHONPATH="$here:$here/benchmarks:${PYTHONPATH:-}" "$@") ;;
    first) (NV_DECODE_OPEN_TAIL=0 PYTHONPATH="$here:$here/benchmarks:${PYTHONPATH:-}" "$@") ;;
  esac
}
kernel_py="import torch, rope_store_gpu as r; from nvcli.models.layers.rotary import RotaryEmbedding as R
r.fp8_rows(R(128, 4096, 1e6, None).cos_sin_cache.to('cuda'), torch.ones(128, device='cuda', dtype=torch.bfloat16))"
for round in 1 2; do
  for variant in base tail first; do
    log="$OUT/kernel_${variant}_$round.log"
    in_variant "$variant" bash -c "cd benchmarks && python3 -c \"$kernel_py\"" > "$log" 2>&1
    while IFS= read -r line; do summary+=("$variant $round | $line"); done < <(grep -E "(no rotary|rotary): .* us" "$log")
    grep -q " us" "$log" || summary+=("$variant $round | FAILED: $(tail -1 "$log")")
  done
done
for round in $(seq 1 "$rounds"); do
  for variant in $e2e_variants; do
    log="$OUT/e2e_${variant}_$round.log"
    in_variant "$variant" python3 benchmarks/gpu_e2e.py --sections fp8 --repeats 3 > "$log" 2>&1
    while IFS= read -r line; do summary+=("$variant e2e $round | ${line#\#\# }"); done < <(grep "^## " "$log" | grep -v "device:")
  done
done
printf '%s\n' "${summary[@]}" | sort -s -t'|' -k2,2
