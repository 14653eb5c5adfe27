# 2026-12-05 late session, this 2-core CPU machine (AMD EPYC, no GPU: the device tool lent none this session), the tree
# of 6fb5162, nothing else running. The compiled host layout built by scripts/setup_env.sh
# (python -m sglang_cpkv.runtime.host_layout_build), then:
.venv/bin/python benchmark/bench_host_layout.py --reps 300 --out host_layout_cpu.json   # printed: host_layout_cpu.txt
#
# The two mutations of the layout moved to the compiled source, with the rows that name them (the tree of bd8e1c0;
# the report's lines are this run's printed report):
.venv/bin/python scripts/mutation.py --row "radix cache" --row "prefill CP, interleave" --no-report
#
# Prepared for the next GPU call, not run (no machine lent: two refused starts, then "no new device machine is lent"):
# .ab/call14.sh - bench_plan_host.py with the library moved aside (numpy) and in place (compiled), taking turns, two
#   each; plan_host_phases.py; bench_plan_host.py --profile at 64 requests
# .ab/call15.sh - runtime/test_runtime_cuda.py, kernels/test_ops_parity_sweep.py (the Triton ops on the GPU, the
#   current tokens' op among them), integration/test_cp_shared_kv_kit_cuda.py, harness/test_serving_harness_cuda.py
