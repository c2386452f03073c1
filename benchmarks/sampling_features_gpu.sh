#!/usr/bin/env bash
# One device call for the sampling features (n > 1, penalties): their tests on the GPU, the float32 identity,
# the DESIGN workload beside a base tree, and what the features cost on that workload.
#   bash benchmarks/sampling_features_gpu.sh BASE_TREE [TESTS...]
# BASE_TREE: `git archive <commit>` of the tree to compare with (e.g. .baseline).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
base=$1; shift
tests=("$@")
if [ ${#tests[@]} -gt 0 ]; then
  python3 -m pytest -q -p no:cacheprovider "${tests[@]}" > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; tail -n 5 "$OUT/pytest.log"
fi
python3 benchmarks/gpu_e2e.py --sections correctness,sampling --repeats 2 > "$OUT/e2e.log" 2>&1
echo "gpu_e2e exit $?"
OUT=$OUT bash benchmarks/tree_ab_gpu.sh "$base" throughput 3 2
grep "^|" "$OUT/e2e.log"
