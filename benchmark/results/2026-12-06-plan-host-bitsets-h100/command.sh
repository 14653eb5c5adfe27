# 2026-12-06, one H100 80GB HBM3 (device tool, nvidia-h100-x1; host: Intel Xeon, 16 cores). "after": the tree of
# 2a6d151 (this session's bit-set host layout, plain-Python lengths, slot_req unstaged; env_h100.txt's commit line reads
# 8e50ec1, which differs from 2a6d151 only by an uncalled function removed). "before": 70e9eb9's python/ and sgl-kernel/
# (the CUDA sources are the same in both, so one AOT library serves both trees):
#   git archive 70e9eb9 python sgl-kernel | tar x -C .ab/before
# Set-up, on the device machine:
AOT_ARCHS=90a STEPS=none OUT=$W bash benchmark/gpu_validation.sh
. /tmp/cpkv-site/cpkv-env.sh; export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot
BASE_PP=$PYTHONPATH; BEFORE=$PWD/.ab/before/python
python3 -m sglang_cpkv.runtime.host_layout_build                             # the after library
PYTHONPATH=$BEFORE:$BASE_PP python3 -m sglang_cpkv.runtime.host_layout_build  # the before library
# Call 1: after, before, after, before, one process each, taking turns (plan_{after,before}{1,2}.txt):
python3 -u benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_after1.json
PYTHONPATH=$BEFORE:$BASE_PP python3 -u benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_before1.json
python3 -u benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_after2.json
PYTHONPATH=$BEFORE:$BASE_PP python3 -u benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_before2.json
python3 -u benchmark/plan_host_phases.py --requests 1,64 --out plan_phases_flashmla_kv.json  # phases.txt
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q -p no:cacheprovider -rs test/registered/runtime/test_runtime_cuda.py
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q -p no:cacheprovider -rs test/registered/integration/test_cp_shared_kv_kit_cuda.py
# Call 2, the same machine still warm (after only):
python3 -u benchmark/bench_plan_host.py --requests 16,32 --reps 30 --out plan_host_flashmla_kv_after_16_32.json
python3 -u benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 --history 32768 \
  --extend 1024 --sharing distinct,shared --layers 6 --reps 8 --processes 3 --out forward_flashmla_kv_fp8_h100_32k.json
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q -p no:cacheprovider -rs test/registered/harness/test_serving_harness_cuda.py
# Call 3, a fresh start (asked for an H200; an H100 80GB HBM3 came, the same host or not is not known), after only,
# after the set-up above (plan_after3_fresh_start.txt):
python3 -u benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_after3_fresh_start.json
