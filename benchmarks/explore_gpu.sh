#!/usr/bin/env bash
# Measure-first pass on one GPU, before choosing defaults. Steps (all by default; name some to run
# only those, each well under 5 minutes): kernel_tests (pytest tests/kernels on the GPU), correctness
# (GPU vs CPU float32 end to end), gemm_mid (cuBLAS vs the Triton tiles at M 32..256), attn_sweep
# (decode attention at the workload's shapes), timeline (the bf16 workload, each batch bucket against
# its bandwidth floor and the GPU's idle time between steps), steps (kernel tables of decode steps at
# batch 1, 64 and 256), startup (benchmarks/startup.py on an empty Triton cache, then again on the one
# it filled). Full logs go to $OUT, summaries to stdout.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
steps=${*:-kernel_tests correctness gemm_mid attn_sweep timeline}
run() { local name=$1; shift; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; echo "[$name] exit $? in $((SECONDS - t0)) s"; }
for s in $steps; do
  case $s in
    kernel_tests) run $s timeout 240 python3 -m pytest -q -x tests/kernels; tail -3 "$OUT/$s.log" ;;
    correctness) run $s timeout 150 python3 benchmarks/gpu_e2e.py --sections correctness; grep "^## " "$OUT/$s.log" ;;
    gemm_mid) run $s timeout 300 python3 benchmarks/skinny_gemm.py --mid; grep -v "next\|skip" "$OUT/$s.log" | tail -25 ;;
    attn_sweep) run $s timeout 300 python3 benchmarks/profile_gpu.py --sections sweep
                grep "^bf16\|^fp8\|copy band" "$OUT/$s.log" | sort -u ;;
    timeline) run $s timeout 150 python3 benchmarks/profile_gpu.py --sections timeline
              grep -A 14 "run 2" "$OUT/$s.log" | head -16 ;;
    steps) run $s timeout 200 python3 benchmarks/profile_gpu.py --sections steps --batches 1:600,64:1400,256:700
           grep -A 15 "^batch" "$OUT/$s.log" | head -60 ;;
    startup) # site-packages here ship without bytecode (every import compiles its source, ~4 s); a user's
             # install has it, so compile it once into a prefix first
             export PYTHONPYCACHEPREFIX=/tmp/pyc
             t0=$SECONDS; timeout 150 python3 -m compileall -q -j 16 $(python3 -c "import sys; print(' '.join(p for p in sys.path if 'packages' in p))") /tmp/site > /dev/null 2>&1
             echo "[compileall] $((SECONDS - t0)) s"
             # compiled ahead on threads (NV_COMPILE_AHEAD=threads) vs in worker processes (the default), each on
             # an empty cache, bf16 and fp8 KV; then warm (the marker skips compile-ahead)
             cache=$(mktemp -d)
             NV_COMPILE_AHEAD=threads TRITON_CACHE_DIR=$cache run startup_threads_cold timeout 200 python3 benchmarks/startup.py
             cache=$(mktemp -d)
             TRITON_CACHE_DIR=$cache run startup_procs_cold timeout 200 python3 benchmarks/startup.py
             TRITON_CACHE_DIR=$cache run startup_procs_warm timeout 200 python3 benchmarks/startup.py
             cache=$(mktemp -d)
             NV_COMPILE_AHEAD=threads TRITON_CACHE_DIR=$cache run startup_threads_fp8_cold timeout 200 python3 benchmarks/startup.py --kv-cache-dtype fp8
             cache=$(mktemp -d)
             TRITON_CACHE_DIR=$cache run startup_procs_fp8_cold timeout 200 python3 benchmarks/startup.py --kv-cache-dtype fp8
             TRITON_CACHE_DIR=$cache run startup_procs_fp8_warm timeout 200 python3 benchmarks/startup.py --kv-cache-dtype fp8
             for f in threads_cold procs_cold procs_warm threads_fp8_cold procs_fp8_cold procs_fp8_warm; do
               echo "-- $f"; grep "^##\|^CUDA\|compiles,\|compiled .* ahead" "$OUT/startup_$f.log"; done ;;
    *) echo "unknown step $s" ;;
  esac
done
