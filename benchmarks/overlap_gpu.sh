#!/usr/bin/env bash
# One device call for two-batch overlap (engine/overlap.py, session 8), from the repo root with the project on
# PYTHONPATH:
#   bash benchmarks/overlap_gpu.sh [tests] [steps] [ab] [MIN_BATCH ...]
# tests: the CUDA-graph and overlap tests on the GPU;
# steps: profile_gpu.py's per-step wall time at 64, 128 and 256 sequences, overlap off and from 64 rows with
#        each stream priority (NV_OVERLAP_PRIORITY: gemm, attention, none);
# ab:    the workload, bf16 and fp8, overlap off and from each MIN_BATCH (default 64 128), each in its own process.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
parts=(); mins=()
for a in "$@"; do case $a in tests|steps|ab) parts+=("$a") ;; *) mins+=("$a") ;; esac; done
[ ${#parts[@]} -eq 0 ] && parts=(tests steps ab)
[ ${#mins[@]} -eq 0 ] && mins=(64 128)
for part in "${parts[@]}"; do
  case $part in
    tests)
      python3 -m pytest -q -x tests/engine/test_cuda_graphs.py tests/engine/test_overlap.py 2>&1 | tail -3 ;;
    steps)
      for v in off:0:gemm gemm:64:gemm attention:64:attention none:64:none; do
        IFS=: read -r label m prio <<< "$v"
        NV_OVERLAP_MIN_BATCH=$m NV_OVERLAP_PRIORITY=$prio python3 benchmarks/profile_gpu.py --sections steps \
          --batches 64:1400,128:1000,256:700 > "$OUT/steps_$label.txt" 2>&1
        echo "$label:"; grep "^batch" "$OUT/steps_$label.txt" | sort -u
      done ;;
    ab)
      variants=("off:NV_OVERLAP_MIN_BATCH=0")
      for m in "${mins[@]}"; do variants+=("o$m:NV_OVERLAP_MIN_BATCH=$m"); done
      OUT=$OUT bash benchmarks/ab_gpu.sh throughput,fp8 2 "${variants[@]}" ;;
  esac
done
