# 2026-12-05 evening, from the repository root, after scripts/gpu_env/prepare_wheels.sh here; the GPU test environment
# and our CUDA ops AOT-built for sm_90a (benchmark/gpu_validation.sh STEPS=none), then:
#
# 'before' = ce539bd: `git archive ce539bd python/sglang_cpkv benchmark/bench_plan_host.py` with the archive's
# python/sglang_cpkv/csrc symlink replaced by a copy of sgl-kernel/csrc (so the before package loads the CUDA ops:
# each run printed `select_backend('cuda') == 'cuda'` for both packages), put first on PYTHONPATH, its own bench.
#
# call 8, one H200, the tree of 55a50be (the current tokens' arrays made on the device; reverted in 1fce6cf):
python3 .ab-before/benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_h200_before_$i.json  # i = 1, 2, taking turns
python3 benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_h200_after_$i.json            #   with the after runs
python3 benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 \
    --history 32768 --extend 1024 --sharing distinct,shared --layers 4 --reps 8 --processes 3 \
    --out forward_flashmla_kv_fp8_h200_interleaved.json
# call 9, one H200, the same tree: the GPU time of each kernel of one forward, per configuration (the run printed and
# wrote its figures, then hit its 150 s timeout on the way out):
python3 benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 \
    --history 32768 --extend 1024 --sharing shared,distinct --layers 4 --reps 2 --profile --out kernels_flashmla_kv_fp8_h200.json
# call 10, one H100 80GB HBM3 (nvidia-h100-x1: no H200 could be started), the tree of 820f0b3:
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q test/registered/runtime/test_runtime_cuda.py \
    test/registered/integration/test_cp_shared_kv_kit_cuda.py test/registered/harness/test_serving_harness_cuda.py
python3 .ab-before/benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_h100_before.json
python3 benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_h100_after.json
python3 benchmark/plan_host_phases.py --requests 1,8,64 --out plan_phases_flashmla_kv_h100.json
# call 9 also: PHASE_SYNC=1 python3 phases_precursor_55a50be.py plan_phases_flashmla_kv_h200_55a50be.json  (the precursor of benchmark/plan_host_phases.py;
#   removed from this folder in issue 55, code does not live under results/: git show 8586cf3:benchmark/results/2026-12-05-evening-plan-ops/phases_precursor_55a50be.py)
