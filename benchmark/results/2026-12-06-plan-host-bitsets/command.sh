# 2026-12-06 session, issue 35 item 4: the plan's host path made lighter where it runs cold. CPU machine (2 cores, no
# GPU), the tree of this directory's commit; "before" = 70e9eb9 (the previous session's last tree), exported with
#   git archive 70e9eb9 python sgl-kernel | tar -x -C .ab/before
# and its own compiled layout built there:
PYTHONPATH=$PWD/.ab/before/python .venv/bin/python -m sglang_cpkv.runtime.host_layout_build
.venv/bin/python -m sglang_cpkv.runtime.host_layout_build
# The hook's phases in place on the CPU (triton_sparse_mla, bf16 pool, reference ops; 1 and 64 requests x (8192 +
# 1024) tokens, median of 20 calls), after / before / after / before, one process each:
.venv/bin/python benchmark/plan_host_phases.py --device cpu --requests 1,64 --reps 20 --out phases_cpu_after_run2.json      # phases_cpu_after_run{1,2}.txt
PYTHONPATH=$PWD/.ab/before/python .venv/bin/python benchmark/plan_host_phases.py --device cpu --requests 1,64 --reps 20 \
    --out phases_cpu_before_run2.json                                                                                  # phases_cpu_before_run{1,2}.txt
# The two rows whose mutations are in plan_layout.cc, re-run on the bit-set layout (four mutations, all caught):
.venv/bin/python scripts/mutation.py --row "prefill CP, interleave" --row "radix cache" --no-report                     # mutation_rows.txt
# After the flat pass re-indented the region-key line (the record fixed), the row re-run on the final source:
.venv/bin/python scripts/mutation.py --row "prefill CP, interleave" --no-report                                        # mutation_interleave_rerun.txt
# Layout + staging called alone (warm), 64 requests, cp 1 and 8; the before tree with its own script
# (git show 70e9eb9:benchmark/bench_host_layout.py > .ab/bench_host_layout_before.py):
.venv/bin/python benchmark/bench_host_layout.py --requests 64 --cp 1,8 --reps 200 --out host_layout_cpu_after.json  # .txt
PYTHONPATH=$PWD/.ab/before/python .venv/bin/python .ab/bench_host_layout_before.py --requests 64 --cp 1,8 --reps 200 \
    --out host_layout_cpu_before.json                                                                                  # .txt
