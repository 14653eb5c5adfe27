# 2026-12-07, one H100 80GB HBM3 (device tool), the tree of 911bc8f; carried: .whl, .cache/ab (setup.sh: ../2026-12-07-issue55-plan-h100/command.sh).
# gpu_soak_h100_cp1_911bc8f.json and test_runtime_cuda_911bc8f.txt; its two forwards hit their 60 s limit (re-run: ../2026-12-07-h100-forward-8k/).
# --- .cache/ab/call5.sh:
# Call 5: after 9fdf4bf (start-up warm-up at every cp, concrete staging device, the soak's output layouts): the CUDA
# runtime tests, the GPU soak's four routes at cp 1, then flashmla_sparse bf16 and flashmla_kv FP8 forwards at 8K.
T0=$(date +%s)
. .cache/ab/setup.sh
echo "setup done at $(( $(date +%s) - T0 )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt
A="env PYTHONPATH=$R/python:$BASE_PP python3"
timeout 60 $A -m pytest -q -p no:cacheprovider --tb=short test/registered/runtime/test_runtime_cuda.py > $OUT/test_runtime_cuda.txt 2>&1; grep -E "^E |Error|passed|failed" $OUT/test_runtime_cuda.txt | head -12
echo "cuda tests done at $(( $(date +%s) - T0 )) s"
(cd /tmp && SGLANG_CPKV_CUDA_JIT=0 timeout 330 $A -m sglang_cpkv.soak --gpu --device cuda --requests ${REQ:-24} --out $OUT/gpu_soak.json > $OUT/gpu_soak.log 2>&1; echo "soak rc=$?"; grep -E "^\[soak\]|PASS|FAIL" $OUT/gpu_soak.log | cut -c1-600 | tail -12)
echo "soak done at $(( $(date +%s) - T0 )) s"
for r in "flashmla_sparse" "flashmla_kv --fp8"; do
  F="benchmark/bench_kit_layer.py --backend $r --heads 64 --topk 2048 --requests 8 --history 8192 --extend 1024 --sharing distinct,shared --layers 6 --reps 8 --processes 1"
  n=$(echo $r | cut -d' ' -f1)
  [ $(( $(date +%s) - T0 )) -lt 520 ] && { timeout 60 $A $F --out $OUT/forward_8k_$n.json > $OUT/forward_8k_$n.txt 2>&1; echo "fwd $n rc=$?"; grep "history" $OUT/forward_8k_$n.txt | tail -6; }
done
echo "all done at $(( $(date +%s) - T0 )) s"
