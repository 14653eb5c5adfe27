# 2026-12-05 night, from the repository root, after scripts/gpu_env/prepare_wheels.sh here; the GPU test environment
# and our CUDA ops AOT-built for sm_90a (benchmark/gpu_validation.sh STEPS=none; its env.txt's "commit" line names the
# machine's base commit, not the tree that ran: the trees are named below), then:
#
# 'before' = 120a3c1 (the end of the evening session): `git archive 120a3c1 python/sglang_cpkv
# benchmark/bench_plan_host.py` with the archive's python/sglang_cpkv/csrc symlink replaced by a copy of 120a3c1's
# sgl-kernel/csrc, its own AOT library built from those sources (the two trees' CUDA sources differ: the before
# package refuses the after library), first on PYTHONPATH, its own bench:
PYTHONPATH=$PWD/.ab/prev/python:$PYTHONPATH python3 -m sglang_cpkv.ops.cuda_build --aot --arch 90a --out /tmp/cpkv_aot_prev
#
# call 11, one H100 80GB HBM3 ("h100a"), the tree of d8bc652:
SGLANG_CPKV_CUDA_JIT=0 python3 -m pytest -q test/registered/kernels/test_cuda_ops.py
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q test/registered/runtime/test_runtime_cuda.py
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q test/registered/integration/test_cp_shared_kv_kit_cuda.py
# before 1, after 1, before 2 (taking turns; the after 2 run was cut by the call's time guard):
SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot_prev PYTHONPATH=.ab/prev/python:$PYTHONPATH \
  python3 .ab/prev/benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_h100a_before_$i.json
SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot python3 benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_h100a_after_1.json
python3 benchmark/plan_host_phases.py --requests 1,8,64 --out plan_phases_flashmla_kv_h100a.json
#
# call 12, one H100 80GB HBM3 ("h100b", another machine: no H200 could be started), the tree of 38e9f10:
python3 benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 \
  --history 32768 --extend 1024 --sharing distinct,shared --layers 6 --reps 8 --processes 3 --out forward_flashmla_kv_fp8_h100b_layers.json
# before 1, after 1, before 2, after 2 (taking turns), the commands of call 11 with h100b in the file names.
#
# call 13, one H100 80GB HBM3 ("h100c"; asked for an H200), the tree of 43540be:
# the serving harness with the before library's AOT build beside it (cut by its 150 s timeout after its first test):
SGLANG_CPKV_REQUIRE_UPSTREAM=1 timeout 150 python3 -m pytest -q test/registered/harness/test_serving_harness_cuda.py
python3 benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 \
  --history 8192 --extend 1024 --sharing distinct,shared --layers 6 --reps 8 --processes 3 --out forward_flashmla_kv_fp8_h100c_layers_8k.json
