"""A small soak scenario of the FP8 RAGGED route (flashmla_sparse with an FP8 pool) at cp 2 with the radix cache on.

Run at commit 761ae9b's tree (its report benchmark/results/2026-12-07-soak/ragged-cp2.json; the script lived in that
folder as ragged_scenario.py until issue 55):
    # from the repository root, after make setup:
    TRITON_INTERPRET=1 .venv/bin/python benchmark/soak_ragged_scenario.py 100 106 "$(mktemp -d)" ragged-cp2.json
"""

import json
import sys
from pathlib import Path

from sglang_cpkv.soak import report
from sglang_cpkv.soak.cli import run_scenario
from sglang_cpkv.soak.server import ServerConfig
from sglang_cpkv.soak.workload import WorkloadConfig

if __name__ == "__main__":
    server = ServerConfig(cp=2, prefill_backend="flashmla_sparse", fp8=True, chunked_prefill_size=256)
    workload = WorkloadConfig(requests=int(sys.argv[1]), seed=int(sys.argv[2]), median_message=24, max_prompt=400)
    r = run_scenario(server, workload, device="cpu", workdir=Path(sys.argv[3]))
    print(report.summary_line(r))
    Path(sys.argv[4]).write_text(json.dumps(report.whole([r]), indent=1))
    sys.exit(0 if r["passed"] else 1)
