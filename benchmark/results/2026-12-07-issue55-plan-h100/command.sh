# 2026-12-07, one H100 80GB HBM3 (device tool, nvidia-h100-x1; host: Intel Xeon, 16 cores), issue 55 item 1.
# after = the tree of 94f0a83 (the numpy layout, one pinned PlanStaging a backend; its wait on the previous copy was
#         still an unconditional event synchronize, since replaced by query-first in e218768, not measured)
# before = 514391d (the compiled C++ layout, a new pinned staging per batch): python/ and the two benchmark scripts,
#          each process with its own tree:
#   mkdir -p .cache/ab/before && git archive 514391d python sgl-kernel benchmark/bench_plan_host.py \
#     benchmark/bench_kit_layer.py | tar x -C .cache/ab/before
# carried: .whl (scripts/gpu_env/prepare_wheels.sh) and .cache/ab; on the device machine (setup.sh: the GPU test env,
# the AOT CUDA ops for 90a, the before tree's compiled layout):
# --- .cache/ab/setup.sh:
# Device-side set-up, idempotent on a warm machine (TEST-ONLY GPU env, the AOT CUDA ops, the before tree's layout).
set -u
R=$PWD
if [ ! -f /tmp/cpkv_aot/sglang_cpkv_cuda.so ]; then
  AOT_ARCHS=90a STEPS=none OUT=$OUT/setup bash benchmark/gpu_validation.sh > $OUT/setup.log 2>&1
  echo "setup rc=$?"; tail -3 $OUT/setup.log
fi
. /tmp/cpkv-site/cpkv-env.sh
export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot PYTHONUNBUFFERED=1
BASE_PP=$PYTHONPATH
BEFORE=$R/.cache/ab/before/python
ls $BEFORE/sglang_cpkv/runtime/prebuilt/*.so >/dev/null 2>&1 || PYTHONPATH=$BEFORE:$BASE_PP python3 -m sglang_cpkv.runtime.host_layout_build
after() { PYTHONPATH=$R/python:$BASE_PP python3 "$@"; }
before() { PYTHONPATH=$BEFORE:$BASE_PP python3 "$@"; }
# ---
A="env PYTHONPATH=$R/python:$BASE_PP python3"
B="env PYTHONPATH=$BEFORE:$BASE_PP python3 $R/.cache/ab/before/"
P="benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --device cuda"
$A $P --out plan_after1.json      # plan_host_h100.txt, first half
$B$P --out plan_before1.json      # plan_host_h100.txt, second half
F="benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 --history 32768 --extend 1024 --sharing distinct,shared --layers 6 --reps 8 --processes 1"
$A $F --out forward_after.json    # forward_after.txt
$B$F --out forward_before.json    # forward_before.txt
