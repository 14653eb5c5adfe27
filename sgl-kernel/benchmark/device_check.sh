#!/usr/bin/env bash
# One device-machine run of the CUDA CP shared-KV ops: AOT build (image archs) and JIT build in parallel, the CUDA
# test suite on the AOT library, a JIT-load check, the quick benchmark, a SASS look at the copy loop and a
# compute-sanitizer memcheck of a slice of the tests (uncached allocator, so reads past a tensor are caught).
# Usage (repo root, GPU machine without sglang): OUT=/some/dir sgl-kernel/benchmark/device_check.sh
set -uo pipefail
export PYTHONPATH=python PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cpkv_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
nvcc --version | tail -2 | tee -a "$OUT/env.txt"
start=$(date +%s)
(python3 -m sglang_cpkv.ops.cuda_build --aot --arch 90a,100a,103a --out /tmp/cpkv_aot >"$OUT/aot.log" 2>&1; echo "aot rc=$?" >>"$OUT/aot.log") &
(SGLANG_CPKV_CUDA_CACHE=/tmp/cpkv_jit python3 -m sglang_cpkv.ops.cuda_build >"$OUT/jit.log" 2>&1; echo "jit rc=$?" >>"$OUT/jit.log") &
wait
echo "builds took $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/aot.log" "$OUT/jit.log"
export SGLANG_CPKV_CUDA_CACHE=/tmp/cpkv_jit
[ -f /tmp/cpkv_aot/sglang_cpkv_cuda.so ] && export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot
timeout 150 python3 -m pytest test/registered/kernels/test_cuda_ops.py -q -rfE --tb=short -p no:cacheprovider 2>&1 | tee "$OUT/test_cuda_ops.log" | tail -n 40
(unset SGLANG_CPKV_CUDA_LIB; SGLANG_CPKV_CUDA_JIT=1 python3 -c "from sglang_cpkv.ops import cuda; print('JIT-cached library reason:', cuda.unavailable_reason())")
timeout 100 python3 sgl-kernel/benchmark/bench_cp_shared_kv_cuda.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
cuobjdump --dump-sass --gpu-architecture sm_90a /tmp/cpkv_aot/sglang_cpkv_cuda.so 2>/dev/null | grep -cE "LDG.E.128" | sed 's/^/LDG.E.128 count in sm_90a SASS: /'
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest \
  test/registered/kernels/test_cuda_ops.py -q -p no:cacheprovider -k "odd_widths or shared_page or (remap_locs and 3-16) or \
  (copy_pages and bf16-16) or (scatter_rows and -3-) or (materialize_and_fill and 3-16-fp8) or bad_ids_and" 2>&1 |
  tee "$OUT/memcheck.log" | tail -n 12
