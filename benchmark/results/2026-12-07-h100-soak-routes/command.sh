# 2026-12-07, one H100 80GB HBM3 (device tool), the tree of 4d54937 (after) and 514391d (before: python/ and the
# benchmark scripts in .cache/ab/before, as in ../2026-12-07-issue55-plan-h100/command.sh). carried: .whl, .cache/ab.
# --- .cache/ab/call4.sh:
# Call 4: CUDA runtime tests; GPU soak routes (flashmla_kv FP8 mode off/on, flashmla_sparse bf16, triton_sparse_mla);
# flashmla_sparse bf16 forward at the deployed shape, after (HEAD) and before (514391d).
T0=$(date +%s)
. .cache/ab/setup.sh
echo "setup done at $(( $(date +%s) - T0 )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt
A="env PYTHONPATH=$R/python:$BASE_PP python3"
B="env PYTHONPATH=$BEFORE:$BASE_PP python3 $R/.cache/ab/before/"
timeout 60 $A -m pytest -q -p no:cacheprovider --tb=short test/registered/runtime/test_runtime_cuda.py > $OUT/test_runtime_cuda.txt 2>&1; grep -E "^E |Error|passed|failed" $OUT/test_runtime_cuda.txt | head -12
echo "cuda tests done at $(( $(date +%s) - T0 )) s"
(cd /tmp && SGLANG_CPKV_CUDA_JIT=0 timeout 230 $A $R/.cache/ab/gpu_diag.py $OUT/gpu_diag.json ${REQ:-10} > $OUT/gpu_diag.log 2>&1; echo "diag rc=$?"; grep -E "mode_on=|^    " $OUT/gpu_diag.log | cut -c1-900)
echo "diag done at $(( $(date +%s) - T0 )) s"
F="benchmark/bench_kit_layer.py --backend flashmla_sparse --heads 64 --topk 2048 --requests 8 --history 32768 --extend 1024 --sharing distinct,shared --layers 6 --reps 8 --processes 1"
timeout 80 $A $F --out $OUT/forward_sparse_after.json > $OUT/forward_sparse_after.txt 2>&1; echo "fwd after rc=$?"; grep "history" $OUT/forward_sparse_after.txt | tail -6
timeout 80 $B$F --out $OUT/forward_sparse_before.json > $OUT/forward_sparse_before.txt 2>&1; echo "fwd before rc=$?"; grep "history" $OUT/forward_sparse_before.txt | tail -6
echo "all done at $(( $(date +%s) - T0 )) s"
# --- .cache/ab/gpu_diag.py:
# """The GPU soak's routes one by one (cp 1), flashmla_kv FP8 with the mode off too: is a mismatch the mode's or the check's?"""
# import dataclasses
# import json
# import sys
# import tempfile
# from pathlib import Path
# 
# from sglang_cpkv.soak.cli import gpu_scenarios, run_scenario
# 
# if __name__ == "__main__":
#     out = Path(sys.argv[1])
#     requests = int(sys.argv[2])
#     runs = []
#     scen = gpu_scenarios()
#     picks = [(1, False), (1, True), (0, True), (3, True)]
#     for index, mode_on in picks:
#         server, workload = scen[index]
#         server = dataclasses.replace(server, mode_on=mode_on)
#         workload = dataclasses.replace(workload, requests=requests)
#         r = run_scenario(server, workload, device="cuda", workdir=Path(tempfile.mkdtemp()))
#         r["mode_on"] = mode_on
#         runs.append(r)
#         f = r["figures"]
#         print(f"{r['label']} mode_on={mode_on}: passed={r['passed']} served={f['served']} batches={f['batches']} "
#               f"outputs={f['kernel_outputs_checked']} reads={f['reads_checked']} mismatches={f['mismatches']} "
#               f"syncs={f['mode_host_syncs_max_per_batch']} where={f.get('mode_host_syncs_where')}", flush=True)
#         for p in r["problems"][:4]:
#             print("   ", str(p)[:700], flush=True)
#         out.write_text(json.dumps(runs, indent=1, default=str))
