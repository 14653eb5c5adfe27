#!/usr/bin/env bash
# The long soak of issue 52, on the project's 2-core CPU machine (Debian 12, Python 3.11, torch 2.13.0+cpu,
# triton 3.7.1 under TRITON_INTERPRET=1, mooncake-transfer-engine-non-cuda 0.3.13.post1 over TCP on loopback).
# Run from a frozen copy of the package and of the patched upstream tree (commit 0c31c2c), so that edits made in
# the checkout while it ran could not change the code under test:
#   mkdir /tmp/soak-code && cp -rL python/sglang_cpkv /tmp/soak-code/ \
#     && cp -r .venv/lib/python3.11/site-packages/sglang /tmp/soak-code/
set -euo pipefail
cd /tmp
PYTHONPATH=/tmp/soak-code TRITON_INTERPRET=1 /work/main/.venv/bin/python -m sglang_cpkv.soak \
  --minutes 100 --cp 1,2,4 --out /work/main/benchmark/results/2026-12-07-soak/long.json --workdir /tmp/soak-long
