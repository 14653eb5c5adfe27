# make test on the project's 2-core CPU machine, quiet (no other job), 2026-12-07:
#   start=$(date +%s); make test > make_test.log 2>&1; echo "rc=$? wall=$(( $(date +%s) - start ))s"
# suite.txt: the tree of 361b9f0 (1011 s). suite-911bc8f.txt: the tree of 911bc8f (853 s): the Triton interpreter's
# dropped overflow checks skipped (testing/dsa_kit.py), fresh-world kit runs shared within a file
# (testing/kit_cases.run_case), the planner's million-entry flagged batch on the torch reference.
