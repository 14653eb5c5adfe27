# 2026-12-05, one H200 (nvidia-h200), from the repository root, after scripts/gpu_env/prepare_wheels.sh here. One call (479 s).
# 'before': the package at fc20d69 (git archive fc20d69 python/sglang_cpkv, unpacked into .ab/old, put first on PYTHONPATH);
# 'after': the tree of 9cc331c. The GPU test environment and the CUDA ops (AOT, sm_90a) are the same for both.
set -o pipefail
W=/tmp/w; mkdir -p $W
AOT_ARCHS=90a STEPS=none OUT=$W bash benchmark/gpu_validation.sh > $W/setup.log 2>&1 || tail -20 $W/setup.log
. /tmp/cpkv-site/cpkv-env.sh; export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot; base=$PYTHONPATH
run() { v=$1; shift; if [ $v = before ]; then PYTHONPATH=$PWD/.ab/old:$base "$@"; else PYTHONPATH=$base "$@"; fi; }
for i in 1 2; do for v in before after; do
  run $v timeout 240 python3 benchmark/bench_plan_host.py --requests 1,8,16,32,64 --reps 20 --out $W/plan_${v}_$i.json > $W/plan_${v}_$i.log 2>&1
  echo "== plan $v $i"; grep -E "requests +mode" $W/plan_${v}_$i.log
done; done
timeout 120 python3 benchmark/bench_plan_host.py --requests 1,64 --reps 10 --profile --out $W/plan_profile_after.json > $W/plan_profile_after.log 2>&1
for v in before after; do
  run $v timeout 200 python3 benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 \
    --history 32768 --extend 1024 --sharing distinct,shared --layers 4 --reps 5 --processes 3 --out $W/forward_$v.json > $W/forward_$v.log 2>&1
  echo "== forward $v"; grep -vE '^\[20|[Ww]arn|^process ' $W/forward_$v.log | tail -n 9
done
tar czf $OUT/call1.tgz -C $W .
