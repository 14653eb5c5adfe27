"""A soak scenario whose prompts reach past 40% of a node's pool (the livelock's shape: cp 2, HiCache, 15 MiB).

Run (commit a6097ee, the admission fix applied), its report benchmark/results/2026-12-07-soak/owner-class-admission.json
(the script lived in that folder as owner_class_admission_scenario.py until issue 55):
    # from the repository root, after make setup:
    TRITON_INTERPRET=1 .venv/bin/python benchmark/soak_owner_class_admission_scenario.py 200 7 2300 "$(mktemp -d)" out.json
(requests, seed, longest prompt: under the bootstrap bound of this 2,560-token node pool, 2,368.)
"""

import json
import sys
from pathlib import Path

from sglang_cpkv.soak import report
from sglang_cpkv.soak.cli import run_scenario
from sglang_cpkv.soak.server import ServerConfig
from sglang_cpkv.soak.workload import WorkloadConfig

if __name__ == "__main__":
    server = ServerConfig(cp=2, hicache=True, kv_budget_mib=15, chunked_prefill_size=256)
    workload = WorkloadConfig(
        requests=int(sys.argv[1]), seed=int(sys.argv[2]), max_prompt=int(sys.argv[3]), median_message=200
    )
    r = run_scenario(server, workload, device="cpu", workdir=Path(sys.argv[4]))
    print(
        report.summary_line(r),
        r["figures"].get("host_hit_tokens"),
        r["workload"]["prompt_tokens"],
        r["processes"][0].get("node_tokens"),
    )
    Path(sys.argv[5]).write_text(json.dumps(report.whole([r]), indent=1))
    sys.exit(0 if r["passed"] else 1)
