#!/usr/bin/env bash
# The DeepGEMM warm-up M grid under CP (patches/core/split-deep-gemm-warmup-m-grid-under-cp.patch), re-run on
# 2026-12-07 for benchmark/README.md (the first run, 2026-11-30, kept no output: ../2026-11-30-deep-gemm-warmup/).
# Arithmetic with the patch's own policy functions, no GPU; the project's CPU machine, commit 514391d. Under 2 s each.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=benchmark/results/2026-12-07-deep-gemm-warmup
.venv/bin/python benchmark/deep_gemm_warmup_kernel_count.py --cp 8 --chunked-prefill-size 65536 > $D/glm51-cp8.txt 2>&1
.venv/bin/python benchmark/deep_gemm_warmup_kernel_count.py --cp 8 --chunked-prefill-size 65536 --mtp > $D/glm51-cp8-mtp.txt 2>&1
# Results: interleave with --moe-dense-tp-size 1 --moe-a2a-backend deepep (and zigzag with --max-running-requests 1):
# 1,050,624 -> 133,120 kernels (7.89x fewer); with --mtp 1,181,696 -> 149,504 (7.90x); interleave defaults unchanged.
