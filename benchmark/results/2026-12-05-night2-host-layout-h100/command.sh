# 2026-12-05 night-2 session, one H100 80GB HBM3 (device tool, nvidia-h100-x1; host: Intel Xeon, 16 cores), the tree
# of a9bca13 (the compiled host layout; the kit test's source lookup fixed after the first run, see below).
# Set-up (the environment of scripts/gpu_env, the AOT CUDA ops for sm_90a, the host layout's library):
#   AOT_ARCHS=90a STEPS=none OUT=$W bash benchmark/gpu_validation.sh
#   . /tmp/cpkv-site/cpkv-env.sh; export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot
#   python3 -m sglang_cpkv.runtime.host_layout_build
# Then, in this order on the one machine:
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q -p no:cacheprovider -rs test/registered/runtime/test_runtime_cuda.py  # test_runtime_cuda.tail.txt
python3 -u benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_compiled.json            # plan_compiled.txt
python3 -u benchmark/plan_host_phases.py --requests 1,8,64 --out plan_phases_flashmla_kv.json                            # phases.txt
# the library moved aside (python/sglang_cpkv/runtime/prebuilt -> prebuilt.off): the plan's numpy layout, same machine
python3 -u benchmark/bench_plan_host.py --requests 1,8,64 --reps 30 --out plan_host_flashmla_kv_numpy.json               # plan_numpy.txt
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q -p no:cacheprovider -rs test/registered/integration/test_cp_shared_kv_kit_cuda.py
#   -> test_cp_shared_kv_kit_cuda.first_run.txt: 39 passed, 2 failed, both in the test's own lookup of the plan's host
#      copy line in plan.py (it searched for "host = table.cpu()", a line the compiled layout's change rewrote);
#      fixed in the test (the one line holding "table.cpu()"), then re-run on the same warm machine:
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q -p no:cacheprovider -s test/registered/integration/test_cp_shared_kv_kit_cuda.py -k one_host_sync
#   -> test_cp_shared_kv_kit_cuda.sync_rerun.txt (2 passed)
SGLANG_CPKV_REQUIRE_UPSTREAM=1 python3 -m pytest -q -p no:cacheprovider -rs test/registered/harness/test_serving_harness_cuda.py  # test_serving_harness_cuda.tail.txt
#
# After the H100 run, on the 2-core CPU machine (no GPU left in the session's budget): plan_layout.cc reads the ids,
# flags and requests in one pass and keeps its per-entry arrays grown (the tree of the commit that adds these files):
.venv/bin/python -m sglang_cpkv.runtime.host_layout_build
.venv/bin/python benchmark/bench_host_layout.py --reps 300 --out host_layout_cpu_two_pass.json  # printed: host_layout_cpu_two_pass.txt
# (the late session's same command before this change: ../2026-12-05-late-host-layout/host_layout_cpu.txt)
