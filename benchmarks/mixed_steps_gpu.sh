#!/usr/bin/env bash
# Steps that carry prompt chunks beside running decodes (a long job's steady state), on the GPU, one device call per
# group of sections:   bash benchmarks/mixed_steps_gpu.sh SECTION...
# tests: the attention-kernel and CUDA-graph tests; mixed: profile_gpu.py's mixed section (decode-only steps against
# steps that admit a prompt: wall, host launch, kernels) with mixed graphs (default), eager split steps
# (NV_MIXED_GRAPHS=0) and one prefill kernel for every row (NV_SPLIT_MIXED=0), in turn; streaming: gpu_e2e's
# streaming job (1,024 requests through 128 slots) default / NV_SPLIT_MIXED=0 / default / NV_SPLIT_MIXED=0;
# design: the DESIGN.md workload (bf16, median of 3) default and NV_SPLIT_MIXED=0, in turn; tree-mixed: the mixed
# section from the tree in $BASE_TREE (default .baseline, a `git archive` of the base commit) and from this one, in
# turn, two rounds; host-profile: the mixed section with a host cProfile of each kind of step (PROFILE_CPROFILE_MIXED).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
for section in "$@"; do
  echo "=== $section"
  case $section in
    tests)
      python3 -m pytest -q -x tests/kernels/test_attention_kernels.py tests/engine/test_cuda_graphs.py \
        tests/engine/test_model_runner.py 2>&1 | tail -4 ;;
    mixed)
      for mode in "graphs:" "eager-split:NV_MIXED_GRAPHS=0" "unsplit:NV_SPLIT_MIXED=0"; do
        echo "[mixed ${mode%%:*}]"
        env ${mode#*:} python3 benchmarks/profile_gpu.py --sections mixed > "$OUT/mixed_${mode%%:*}.log" 2>&1
        grep -A2 "^decode-only\|^one prompt" "$OUT/mixed_${mode%%:*}.log" | tail -6
      done ;;
    streaming)
      bash benchmarks/ab_gpu.sh streaming 1 "graphs:" "unsplit:NV_SPLIT_MIXED=0" "graphs2:" "unsplit2:NV_SPLIT_MIXED=0" ;;
    design)
      bash benchmarks/ab_gpu.sh throughput 3 "graphs:" "unsplit:NV_SPLIT_MIXED=0" ;;
    tree-mixed)
      base=$(cd "${BASE_TREE:-.baseline}" && pwd); here=$PWD
      for round in 1 2; do
        for tree in "$base" "$here"; do
          label=$([ "$tree" = "$here" ] && echo new || echo base)
          (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" python3 benchmarks/profile_gpu.py --sections mixed) \
            > "$OUT/tree_mixed_${label}_$round.log" 2>&1
          echo "[$label round $round] exit $?"
          grep "^decode-only\|^one prompt" "$OUT/tree_mixed_${label}_$round.log" | tail -2
        done
      done ;;
    host-profile)
      PROFILE_CPROFILE_MIXED=1 python3 benchmarks/profile_gpu.py --sections mixed > "$OUT/host_profile.log" 2>&1
      grep -A40 "^-- host profile, one prompt" "$OUT/host_profile.log" | head -45 ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
