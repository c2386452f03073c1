#!/usr/bin/env bash
# A scoring job (prompt_logprobs on every prompt token) on the GPU, in one device call:
#   bash benchmarks/scoring_gpu.sh BASE_TREE LINES KS [TESTS] [WORKERS]
# e.g. bash benchmarks/scoring_gpu.sh .baseline 1024 none,0,1,5 1   (.baseline: `git archive <commit>` of the base)
# Besides the engine kind per K, each tree runs the `echo` kind (lm-eval-harness's scoring lines) and the `score` kind
# (native lines with prompt_logprobs 20) through the whole job (reader, engine, output lines). WORKERS (e.g. 8): this
# tree once more with that many formatting processes, the job kinds only.
# With TESTS=1 it first runs the scoring kernel's and the engine's prompt-logprobs tests on the GPU (the first-job
# no-compile test included). Then benchmarks/prompt_heavy.py's engine kind, one process per tree (the base tree's
# nvcli under this tree's script), each K in turn in that process, 2 repeats; then this tree's kernel profile of the
# last K. The result tables are printed together at the end.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
base=$(cd "$1" && pwd); lines=$2; ks=$3; tests=${4:-0}; workers=${5:-}
here=$PWD
if [ "$tests" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_logprobs_kernel.py tests/test_outputs.py \
    tests/engine/test_prompt_logprobs.py tests/engine/test_sampler.py \
    "tests/engine/test_cuda_graphs.py::test_a_first_job_compiles_no_kernel_mid_run" \
    "tests/engine/test_cuda_graphs.py::test_prompt_logprobs_from_mixed_graphs_match_cpu" tests/engine/test_logit_bias.py \
    tests/engine/test_structured_outputs.py tests/jobs/test_formatting.py tests/jobs/test_format_pool.py 2>&1 | tail -6
fi
for tree in "$base" "$here"; do
  label=$([ "$tree" = "$here" ] && echo new || echo base)
  extra=$([ "$tree" = "$here" ] && echo "--kernel-profile 12" || echo "")
  t0=$SECONDS
  PYTHONPATH="$tree:${PYTHONPATH:-}" python3 benchmarks/prompt_heavy.py --kinds engine,echo,score --lines "$lines" \
    --max-tokens 1 --repeats 2 --prompt-logprobs "$ks" $extra > "$OUT/scoring_$label.log" 2>&1
  echo "[$label] exit $? in $((SECONDS - t0)) s"
  grep -E "^engine|^echo|^score|under the profiler" "$OUT/scoring_$label.log"
done
if [ -n "$workers" ]; then
  PYTHONPATH="$here:${PYTHONPATH:-}" python3 benchmarks/prompt_heavy.py --kinds echo,score --lines "$lines" \
    --max-tokens 1 --repeats 2 --format-workers "$workers" > "$OUT/scoring_workers.log" 2>&1
  echo "[new, $workers workers] exit $?"; grep -E "^echo|^score" "$OUT/scoring_workers.log"
fi
grep -A12 "under the profiler" "$OUT/scoring_new.log" | tail -14
for label in base new ${workers:+workers}; do echo "== $label"; grep -A10 "^whole jobs" "$OUT/scoring_$label.log"; done
