set -o pipefail; export PYTHONUNBUFFERED=1; cd .carry-gpuenv/repo || exit 1; E=/tmp/cpkv-site/cpkv-env.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -1; python3 -m pip list 2>&1; } > $OUT/pip_list.txt
PYTHONPATH=$PWD/python timeout 120 python3 -m sglang_cpkv.ops.cuda_build --aot --arch 90a --out /tmp/cpkv_aot > $OUT/aot.log 2>&1 && export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot; echo "aot rc=$?"
timeout 270 scripts/gpu_env/run_cuda_suites.sh > $OUT/suite_1gpu.log 2>&1; echo "run_cuda_suites rc=$?"
grep -E '^\[(gpu_env|test-cuda)\]|^(python|torch|triton|transformers|numpy|typing|pydantic|sglang|sgl_kernel|patch|warning|import|gpu_env)' $OUT/suite_1gpu.log | head -40
grep -E '^(=== |files:|FAILED|SKIP)|[0-9]+ (passed|failed|skipped)|Error' $OUT/suite_1gpu.log | head -40
if ! grep -q '^files:' $OUT/suite_1gpu.log && [ -f $E ]; then (. $E; timeout 150 python3 test/run_suite.py --hw cuda --suite cpkv-test-1-gpu > $OUT/suite_fallback.log 2>&1; echo "fallback rc=$?"; grep -E '^(=== |files:|FAILED)' $OUT/suite_fallback.log); fi
if [ -f $E ]; then (. $E; timeout 150 python3 -m pytest scripts/gpu_env/dsa_kit_smoke.py -v -rs -p no:cacheprovider > $OUT/kit_smoke.log 2>&1; echo "kit rc=$?"; grep -E 'PASSED|FAILED|SKIPPED|ERROR|[0-9]+ (passed|failed)|Error' $OUT/kit_smoke.log | head -30); fi
