#!/usr/bin/env bash
# The capacity headline of README.md and benchmark/README.md, re-run on 2026-12-07 (issue 55 item 3: the figures the
# README quoted had no record of their own since 854d83d). The project's 2-core CPU machine, .venv of this checkout,
# commit 514391d (the working tree also held other sessions' uncommitted edits of testing/gpu_env.py and
# requirements/gpu-test-closure.txt, which the planner does not read). About 10 s each; nothing downloaded.
# The .txt files are each command's output less upstream's AWQ/GGUF import warnings.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=benchmark/results/2026-12-07-capacity
.venv/bin/python -m sglang_cpkv.capacity --preset glm-5.1-fp8 --gpu h200 --tp 8 --cp 1,2,4,8 \
  --json $D/glm51-fp8-h200.json > $D/glm51-fp8-h200.txt 2>&1
.venv/bin/python -m sglang_cpkv.capacity --preset glm-5.1-fp8 --gpu h200 --tp 8 --cp 8 --layer-ahead off \
  --json $D/glm51-fp8-h200-layer-ahead-off.json > $D/glm51-fp8-h200-layer-ahead-off.txt 2>&1
.venv/bin/python -m sglang_cpkv.capacity --preset glm-5.1-fp8 --cp 8 --hicache-ratio 2 \
  --json $D/glm51-fp8-hicache2.json > $D/glm51-fp8-hicache2.txt 2>&1
# Results (glm51-fp8-h200.json, rows[cp=8]): the mode 3,417,088 KV tokens against replicated CP's 436,800 (7.82x),
# reservation 0.554 GiB a rank (latent views 420.25 MiB, index-K views 84.56, current-row scratch 41.50, batch plan
# 20.78); upstream's kv-sharding 3,543,040 (8.11x), the mode at its cell 3,811,840 (8.73x). --layer-ahead off:
# 3,451,392 (7.90x), 0.307 GiB. --hicache-ratio 2: 854K tokens and 48.9 GiB of host pool a rank, 6,835K on the node,
# against 874K for replicated CP.
