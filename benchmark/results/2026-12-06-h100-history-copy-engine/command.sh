# 2026-12-06, one H100 80GB HBM3 (device tool, nvidia-h100-x1; driver 580.159.04), the tree of 49721c8 plus
# benchmark/probe_history_copy_engine.py (gpu.txt). One call, set-up then the probe twice (probe.txt):
AOT_ARCHS=90a STEPS=none OUT=$W bash benchmark/gpu_validation.sh
. /tmp/cpkv-site/cpkv-env.sh; export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot
python3 -m sglang_cpkv.runtime.host_layout_build
python3 -u benchmark/probe_history_copy_engine.py --history 32768 --out probe_copy_engine_flashmla_kv_fp8_32k.json
python3 -u benchmark/probe_history_copy_engine.py --history 32768 --contiguous \
  --out probe_copy_engine_flashmla_kv_fp8_32k_contiguous.json
# Two earlier calls of the same session (other H100 starts) ran a first version of the probe from the untracked
# scratch directory; their figures agree in kind (copy engines not under x1.014 a later layer; 16 ms of host time per
# call when the 4,096 random pages were not coalesced into runs) and are not quoted: the files are the two above.
