# 2026-12-06, one H100 80GB HBM3 (device tool, nvidia-h100-x1; driver 580.159.04). The device row's CUDA mutation
# (docs/design/cp-shared-kv-mutations.toml: ops/cuda.py's copy_pages launcher writes each page at its source page index),
# never run before. Set-up on the device machine:
AOT_ARCHS=90a STEPS=none OUT=$W bash benchmark/gpu_validation.sh
. /tmp/cpkv-site/cpkv-env.sh
export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot SGLANG_CPKV_REQUIRE_UPSTREAM=1 TRITON_INTERPRET=0
python3 -m sglang_cpkv.runtime.host_layout_build
# Call 1, the tree of 5862cb3 with --gpu-only added to scripts/mutation.py:
#   python3 -u scripts/mutation.py --row device --gpu-only
#   [mutation] the unchanged tree: 1 tests -> 8 passed (38 s)
#   [mutation] 1/1 device: ... -> missed: 8 passed (46 s)
# The mutated launcher fails the CUDA backend's start-up probe, so the dispatcher fell back to the Triton ops, which
# are right: the kit test passed on the fallback. Fixed in the same commit as this file: a kit world with the mode on
# on a GPU refuses to run unless the CUDA ops serve (testing/dsa_kit.py), and the fallback's log names the probe's
# reason (ops/__init__.py).
# Call 2, the tree with that fix (the report's device line; kit_cuda.txt, harness_cuda.txt):
python3 -u scripts/mutation.py --row device --gpu-only     # caught: 1 failed (30 s); baseline 8 passed (121 s)
cd test/registered
python3 -m pytest -q -p no:cacheprovider -rs integration/test_cp_shared_kv_kit_cuda.py   # 41 passed
python3 -m pytest -q -p no:cacheprovider -rs harness/test_serving_harness_cuda.py       # 2 passed
