# 2026-12-05, from the repository root, after scripts/gpu_env/prepare_wheels.sh here; the GPU test environment and
# our CUDA ops AOT-built for sm_90a (benchmark/gpu_validation.sh STEPS=none), then:
#
# call 5, one H200 (nvidia-h200), the tree of 8869a7a (current tokens' dense locations from their positions):
python3 benchmark/bench_plan_host.py --requests 1,8,16,32,64 --reps 20 --out plan_host_flashmla_kv_h200_$i.json  # i = 1, 2
python3 benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 \
    --history 32768 --extend 1024 --sharing distinct,shared --layers 4 --reps 5 --processes 3 \
    --out forward_flashmla_kv_fp8_h200.json
python3 benchmark/bench_plan_host.py --requests 1,8 --reps 10 --profile --out plan_profile_flashmla_kv_h200.json
#   (the same warm H200, the same tree: 87 top-level torch ops per call with the mode on at 1 request, 35 off)
#
# call 6 (two calls), one H100 80GB HBM3 (nvidia-h100-x1: no H200 could be started), the tree of 9938e0e (the
# CP split's host index tensors on first use, the staging written in place, bench_plan_host interleaving configs):
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q test/registered/runtime/test_runtime_cuda.py \
    test/registered/integration/test_cp_shared_kv_kit_cuda.py test/registered/harness/test_serving_harness_cuda.py
python3 benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_interleaved_flashmla_kv_h100_$i.json  # i = 1, 2
python3 benchmark/bench_kit_layer.py ... (as above) --out forward_flashmla_kv_fp8_h100.json
#
# Each call also ran a 'before' (8924244) from `git archive 8924244 python/sglang_cpkv` put first on PYTHONPATH: not
# used. That archive holds python/sglang_cpkv/csrc as a symlink into sgl-kernel/ that the archive does not carry, so
# the 'before' package refused its prebuilt CUDA library ("CUDA sources of sglang_cpkv not found") and ran the Triton
# ops: a comparison of backends, not of the change. The same held for the 'before' (fc20d69) of
# 2026-12-05-h200-plan-host/.
