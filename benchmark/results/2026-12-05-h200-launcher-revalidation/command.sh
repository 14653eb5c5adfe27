# 2026-12-05, one H200 (nvidia-h200), from the repository root at 41301e0, after scripts/gpu_env/prepare_wheels.sh here.
# call 1 (208 s): PART=a: the CUDA ops, the parity sweep and the runtime's CUDA tests, after the launcher refactor
#   (one RowCopy operand struct, one launcher per op) of ef2e10a
# call 2 (360 s, warm): PART=b: the kit with the real kernels (40 tests), the serving harness (cp 1 and cp 2 over gloo),
#   and `scripts/mutation.py --row device --cuda --no-report`
# call 3 (24 s, warm): the kit's host-sync test again after its fix (the plan's line it names)
PART=a bash .ab/call3.sh      # .ab/call3.sh: the environment set up once per machine, then the files below
PART=b bash .ab/call3.sh
#   kernels/test_cuda_ops.py kernels/test_ops_parity_sweep.py runtime/test_runtime_cuda.py          (PART=a)
#   integration/test_cp_shared_kv_kit_cuda.py harness/test_serving_harness_cuda.py + the mutation  (PART=b)
python3 -m pytest -q -s test/registered/integration/test_cp_shared_kv_kit_cuda.py -k host_sync
