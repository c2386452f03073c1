python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "=== no-compile test, old tree (expect a failure)"
(cd .baseline && PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/engine/test_cuda_graphs.py -k "compiles_no_kernel" 2>&1 | grep -E "assert|passed|failed" | tail -4)
echo "=== GPU tests, new tree"
python3 -m pytest -q tests/engine/test_cuda_graphs.py tests/kernels/test_attention_kernels.py tests/engine/test_model_runner.py tests/engine/test_fp8_kv_cache.py 2>&1 | tail -3
echo "=== DESIGN timeline on an empty Triton cache"
for dt in auto fp8; do
  rm -rf ~/.triton/cache
  python3 benchmarks/profile_gpu.py --kv-cache-dtype $dt --sections timeline > $OUT/tl_$dt.log 2>&1; echo "$dt exit $?"
  grep "^\[1\]\|^\[2\]\|^timeline\|start-up\|startup" $OUT/tl_$dt.log | sort -u | head -12
done
