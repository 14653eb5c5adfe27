# make test on the project's 2-core CPU machine, quiet (no other job), 2026-12-07:
#   start=$(date +%s); make test > make_test.log 2>&1; echo "rc=$? wall=$(( $(date +%s) - start ))s"
# suite.txt: the tree of 361b9f0 (1011 s). suite-911bc8f.txt: the tree of 911bc8f (853 s): the Triton interpreter's
# dropped overflow checks skipped (testing/dsa_kit.py), fresh-world kit runs shared within a file
# (testing/kit_cases.run_case), the planner's million-entry flagged batch on the torch reference.
# mutation-kit-rows-911bc8f.txt: the mutation rows whose named tests read the shared kit runs, re-run on 911bc8f's tree
# (the report left alone):
#   TRITON_INTERPRET=1 .venv/bin/python scripts/mutation.py --no-report --row "model" --row "attention backend" \
#     --row "page size" --row "KV cache dtype" --row "DSA prefill backend" --row "DSA top-k route" --row "IndexShare" \
#     --row "fused indexer"
# suite-72738e3.txt: the same command on the tree of 72738e3 (the session's last): 862 s, all 55 files passed (its
# setup step re-applied the overlay to .venv first).
