# Run 1 (413 s): the repro step (its repro lines failed there: the kit's short requests took the dense-MHA path), the
# cost benchmark, and the kit / serving-harness CUDA files with the real kernels
OUT=$OUT AOT_ARCHS=90a STEPS="ragged kit-cuda" benchmark/gpu_validation.sh
# Run 2: the repro on pristine 0.5.23 (the carried wheel in its own directory) and with the queue
for b in "flashmla_sparse 64" "triton_sparse_mla 32"; do set -- $b
  PYTHONPATH=/tmp/pristine:$PYTHONPATH python3 scripts/repro/ragged_history_less_fp8.py --backend $1 --heads $2
  python3 scripts/repro/ragged_history_less_fp8.py --backend $1 --heads $2
done
