"""The harness's command line (``scripts/run_cp_harness.py``): run :func:`~.serving.run_serving_harness`, print the
summary and every failure, write the JSON report; exit status 0 when every check passed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from sglang_cpkv.harness import serving
from sglang_cpkv.ops import BACKEND_ENV, BACKENDS


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(parser: argparse.ArgumentParser, flag: str, text: str, known) -> list[str]:
    names = list(known) if text == "all" else [s for s in text.split(",") if s]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        parser.error(f"{flag}: unknown {unknown or text!r}; choose from {','.join(known)} or all")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="CP correctness harness: upstream's DSA attention kit through the patched backend on real CP "
        "ranks; every request of a batch equal to its bs=1 run and to the mode-off run."
    )
    parser.add_argument("--cp", type=_int_list, default=[1, 2], help="comma-separated CP sizes (default 1,2)")
    parser.add_argument(
        "--bs-list", type=_int_list, default=[2, 4, 8], help="comma-separated batch sizes (default 2,4,8)"
    )
    parser.add_argument(
        "--scenarios", default="all", help=f"comma-separated from {','.join(serving.SCENARIO_NAMES)} (default all)"
    )
    parser.add_argument(
        "--routes", default="all", help=f"comma-separated from {','.join(serving.ROUTES)} (default all)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dist",
        choices=("nccl", "gloo"),
        default=None,
        help="the ranks' collectives (default: NCCL on cuda, one GPU per rank; gloo on cpu; gloo on cuda puts every "
        "rank on GPU 0)",
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help=f"the mode's ops: sets {BACKEND_ENV} for every rank"
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    # This process is the command: the spawned ranks inherit what it sets.
    if args.backend is not None:
        os.environ[BACKEND_ENV] = args.backend
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kit's Triton kernels on CPU: no GPU driver to load
    start = time.perf_counter()
    report = serving.run_serving_harness(
        args.cp,
        args.bs_list,
        _names(parser, "--scenarios", args.scenarios, serving.SCENARIO_NAMES),
        _names(parser, "--routes", args.routes, serving.ROUTES),
        args.device,
        log=lambda message: print(message, flush=True),
        dist_backend=args.dist,
    )
    report["timings"]["total_seconds"] = round(time.perf_counter() - start, 2)
    report["command"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    summary = report["summary"]
    print(f"checks passed {summary['passed']}/{summary['checks']} {summary['by_kind']}")
    for failure in report["failures"]:
        print("FAILED:", json.dumps(failure, default=str)[:2000])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0 if summary["failed"] == 0 else 1
