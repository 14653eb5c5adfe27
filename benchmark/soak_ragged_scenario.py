"""A small soak scenario of the FP8 RAGGED route (flashmla_sparse with an FP8 pool): by default cp 2, the radix cache
on, chunk 256 (its report benchmark/results/2026-12-07-soak/ragged-cp2.json, at commit 761ae9b's tree, where the
script lived in that folder as ragged_scenario.py); ``--cp 1 --radix off --chunk 200`` is the long soak's scenario
that could not run to its end on the 2-core machine (ragged-cp1-radix-off.json).
    # from the repository root, after make setup:
    TRITON_INTERPRET=1 .venv/bin/python benchmark/soak_ragged_scenario.py 100 106 "$(mktemp -d)" ragged-cp2.json
"""

import argparse
import json
import sys
from pathlib import Path

from sglang_cpkv.soak import report
from sglang_cpkv.soak.cli import run_scenario
from sglang_cpkv.soak.server import ServerConfig
from sglang_cpkv.soak.workload import WorkloadConfig

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests", type=int)
    parser.add_argument("seed", type=int)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("out", type=Path, help="the JSON report")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--radix", choices=("on", "off"), default="on")
    parser.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size")
    args = parser.parse_args()
    server = ServerConfig(
        cp=args.cp,
        prefill_backend="flashmla_sparse",
        fp8=True,
        chunked_prefill_size=args.chunk,
        radix_cache=args.radix == "on",
    )
    workload = WorkloadConfig(requests=args.requests, seed=args.seed, median_message=24, max_prompt=400)
    r = run_scenario(server, workload, device="cpu", workdir=args.workdir)
    print(report.summary_line(r))
    args.out.write_text(json.dumps(report.whole([r]), indent=1))
    sys.exit(0 if r["passed"] else 1)
