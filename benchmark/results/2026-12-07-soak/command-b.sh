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
# long-b2.json's first scenario (cp 1, FP8 RAGGED, 550 requests) was stopped at the driver's fixed 30-minute limit
# with both its processes alive (no stall reported), the machine shared with the first part and `make test`: the
# rest of round 3 then ran from a frozen copy of commit f0b958f (the limit grows with the requests):
#   mkdir /tmp/soak-code3 && cp -rL python/sglang_cpkv /tmp/soak-code3/ && cp -r /tmp/soak-code2/sglang /tmp/soak-code3/
PYTHONPATH=/tmp/soak-code3 TRITON_INTERPRET=1 /work/main/.venv/bin/python -m sglang_cpkv.soak \
  --minutes 200 --cp 2,4 --round 3 --scenarios 2 --seed 102 \
  --out /work/main/benchmark/results/2026-12-07-soak/long-b3.json --workdir /tmp/soak-long-b3
# The first part's last scenario (cp 1, FP8 RAGGED, seed 10) was served at 18 tokens/s with four jobs on the two cores
# and could not end inside its fixed 30-minute limit: it was stopped, and one more cp 1 scenario ran from the same copy:
PYTHONPATH=/tmp/soak-code3 TRITON_INTERPRET=1 /work/main/.venv/bin/python -m sglang_cpkv.soak \
  --minutes 200 --cp 1 --round 0 --scenarios 1 --seed 104 \
  --out /work/main/benchmark/results/2026-12-07-soak/long-b4.json --workdir /tmp/soak-long-b4
# long-b3 (cp 2, FP8 RAGGED, radix on) was served at 3-5 tokens/s (upstream's FP8 dequantization of every history row,
# each layer, in Triton's interpreter, with three other jobs on the two cores): stopped after 25 minutes, before its
# report, with nothing found. Its requests were made up by one more cp 2 scenario:
PYTHONPATH=/tmp/soak-code3 TRITON_INTERPRET=1 /work/main/.venv/bin/python -m sglang_cpkv.soak \
  --minutes 200 --cp 2 --round 0 --scenarios 1 --seed 105 \
  --out /work/main/benchmark/results/2026-12-07-soak/long-b5.json --workdir /tmp/soak-long-b5
