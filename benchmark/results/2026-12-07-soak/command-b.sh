#!/usr/bin/env bash
# The long soak's second part (issue 52), beside the first (command.sh) on the same machine: the rounds the first
# part's 100 minutes did not reach, with new seeds, from a frozen copy of commit 64e320f (the
# owner-class admission fix applied, the matrix that runs every route with the radix cache on and off):
#   mkdir /tmp/soak-code2 && cp -rL python/sglang_cpkv /tmp/soak-code2/ \
#     && cp -r .venv/lib/python3.11/site-packages/sglang /tmp/soak-code2/
set -euo pipefail
cd /tmp
run() { PYTHONPATH=/tmp/soak-code2 TRITON_INTERPRET=1 /work/main/.venv/bin/python -m sglang_cpkv.soak "$@"; }
run --minutes 200 --cp 4 --round 2 --scenarios 1 --seed 100 \
  --out /work/main/benchmark/results/2026-12-07-soak/long-b1.json --workdir /tmp/soak-long-b1
run --minutes 200 --cp 1,2,4 --round 3 --scenarios 3 --seed 101 \
  --out /work/main/benchmark/results/2026-12-07-soak/long-b2.json --workdir /tmp/soak-long-b2
