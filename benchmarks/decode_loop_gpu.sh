#!/usr/bin/env bash
# One device call for the decode-attention tile loop (session 7), from the repo root with the project on PYTHONPATH:
#   bash benchmarks/decode_loop_gpu.sh [kernels] [ab] [steps]
# kernels: GPU kernel tests, benchmarks/decode_variants.py's timing table, Nsight Compute on three fp8 variants at
#          B=256 x 800 tokens (ncu.csv in $OUT);
# ab:      the workload, bf16 and fp8, with the default loop, the old per-token fp8 loop, and PDL for every batch size;
# steps:   profile_gpu.py's per-step kernel table at 64 and 256 sequences.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
parts=${*:-kernels ab steps}
for part in $parts; do
  case $part in
    kernels)
      python3 -m pytest -q -x tests/kernels/test_attention_kernels.py tests/kernels/test_fused_layers.py 2>&1 | tail -3
      python3 benchmarks/decode_variants.py 2>&1 | tee "$OUT/variants.txt" | tail -7
      timeout 200 ncu --clock-control none -k regex:_decode_split --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section Occupancy --csv --page details \
        python3 benchmarks/decode_variants.py --once --variants "fp8 per-token,fp8 runs V tile,fp8 runs V tile 2 st" \
        > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
      echo "ncu exit $?" ;;
    ab)
      python3 -m pytest -q -x tests/kernels/test_attention_kernels.py tests/engine/test_cuda_graphs.py 2>&1 | tail -3
      OUT=$OUT bash benchmarks/ab_gpu.sh throughput,fp8 2 "base:" \
        "old:NV_DECODE_RUN_ADDR=0 NV_FP8_V_DEQUANT_TILE=0" "pdl:NV_PDL_MAX_ROWS=512" ;;
    steps)
      python3 benchmarks/profile_gpu.py --sections steps --batches 64:1400,256:700 > "$OUT/steps.txt" 2>&1
      tail -40 "$OUT/steps.txt" ;;
  esac
done
