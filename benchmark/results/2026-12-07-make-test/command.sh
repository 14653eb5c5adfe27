# make test on the project's 2-core CPU machine, quiet (no other job), the tree of 361b9f0, 2026-12-07:
#   start=$(date +%s); make test > make_test.log 2>&1; echo "rc=$? wall=$(( $(date +%s) - start ))s"
