# 2026-12-07, one H100 80GB HBM3 (device tool), the tree of 7a683fe; carried: .whl (scripts/gpu_env/prepare_wheels.sh), .cache/ab.
# --- .cache/ab/call6.sh (its setup.sh: ../2026-12-07-issue55-plan-h100/command.sh):
# Call 6: flashmla_sparse bf16 and flashmla_kv FP8 forwards at 8 x (8K + 1K), the current tree, one process each.
T0=$(date +%s)
. .cache/ab/setup.sh
echo "setup done at $(( $(date +%s) - T0 )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt
A="env PYTHONPATH=$R/python:$BASE_PP python3"
for r in "flashmla_sparse" "flashmla_kv --fp8"; do
  n=$(echo $r | cut -d' ' -f1)
  F="benchmark/bench_kit_layer.py --backend $r --heads 64 --topk 2048 --requests 8 --history 8192 --extend 1024 --sharing distinct,shared --layers 6 --reps 8 --processes 1"
  left=$(( 300 - ($(date +%s) - T0) ))
  [ $left -gt 30 ] && { timeout $left $A $F --out $OUT/forward_8k_$n.json > $OUT/forward_8k_$n.txt 2>&1; echo "fwd $n rc=$? at $(( $(date +%s) - T0 )) s"; grep "history" $OUT/forward_8k_$n.txt | tail -6; }
done
