# On one H100 (device tool, nvidia-h100-x1), the tree of commit 55f6282 plus the in-place remap case of
# test_cuda_ops.py, with .whl/ carried (scripts/gpu_env/prepare_wheels.sh run on the CPU machine first):
STEPS="suite" AOT_ARCHS=90a OUT=$OUT timeout 580 benchmark/gpu_validation.sh
