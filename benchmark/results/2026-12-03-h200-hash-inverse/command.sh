# 2026-12-03, one H200 (nvidia-h200), from the repository root, after scripts/gpu_env/prepare_wheels.sh here.
# Call 1 (501 s): the registered 1-GPU suite and the ops benchmark (files: bench.json, bench.log, env.txt, suite_1gpu.txt).
OUT=$OUT AOT_ARCHS=90a STEPS="suite ops" OPS_ONLY="remap inverse plan" benchmark/gpu_validation.sh
# Call 2 (25 s): the remap after the home cell's 32 x 32 -> 64-bit multiply (bench_remap_final.log), the tree as committed.
python3 -m sglang_cpkv.ops.cuda_build --aot --arch 90a --out /tmp/cpkv_aot
SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot PYTHONPATH=$PWD/python python3 -m pytest -q -x test/registered/kernels/test_cuda_ops.py -k "remap or shared_page"
SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot PYTHONPATH=$PWD/python python3 benchmark/bench_cp_shared_kv_ops.py --only remap
# A third call (not kept): every element's home cell loaded before any comparison: the top-k remap took 101.7 us
# (against 83.4 us), so that restructuring was reverted.
