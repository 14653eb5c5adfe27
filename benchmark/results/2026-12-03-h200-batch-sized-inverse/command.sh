# Device tool, nvidia-h200, repo root, carry [".whl"] (scripts/gpu_env/prepare_wheels.sh)
# call 1 (411 s): the environment, the AOT build, the registered 1-GPU suite
OUT=$OUT AOT_ARCHS=90a STEPS="suite" benchmark/gpu_validation.sh
# call 2 (146 s): the plan's host cost, the ops benchmark (remap, inverse, plan), the plan's measured device peak
OUT=$OUT AOT_ARCHS=90a STEPS="ops plan-host" OPS_ONLY="remap inverse plan" benchmark/gpu_validation.sh
python3 -m pytest -q -s test/registered/runtime/test_runtime_cuda.py -k b300
# call 3 (32 s): the remap benchmark again after the tile-variant fix (bench_remap.json)
python3 benchmark/bench_cp_shared_kv_ops.py --only remap
