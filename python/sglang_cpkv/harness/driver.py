"""Launch the CP ranks, run every scenario, judge every run against the bs=1 goldens, write the report.

For each ``cp`` of ``cp_list``: cp=1 runs in this process (:class:`~sglang_cpkv.runtime.SingleRankGroup`);
cp>1 spawns ``cp`` ranks (:func:`sglang_cpkv.testing.cp_dist.spawn_cp_ranks`: gloo on CPU, NCCL with
one process per GPU on CUDA). Every rank runs the same :class:`~.engine.HarnessJob`; every rank's
result is judged (each holds the whole dense view of every request).

Checks (each a row of the report, ``passed`` true or false):

* ``golden``: every rank's bs=1 goldens equal rank 0's at the first cp of the list (exact
  arithmetic makes them independent of cp and rank);
* ``batch``: scenario x bs x rank: every request byte-equal to its golden (outputs and dense view
  after every forward) and no foreign marker read; for bs >= 2 the state class computed from the
  page tables must be the scenario's;
* ``negative_control`` (cp=1): the same batch with the 1-D value-keyed inverse. On the collision
  class it must show contamination (some request reads another request's marker); on the
  reachable class it must be harmless (every request byte-equal to its golden).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from sglang_cpkv.harness import serving
from sglang_cpkv.harness.compare import compare_request, judge_run
from sglang_cpkv.harness.engine import HarnessJob, RunTrace, run_job_on_rank
from sglang_cpkv.harness.model import ToyDsaConfig
from sglang_cpkv.harness.report import device_line, summarize
from sglang_cpkv.harness.scenarios import SCENARIO_NAMES, build_scenarios
from sglang_cpkv.ops import BACKEND_ENV, BACKENDS
from sglang_cpkv.runtime import SingleRankGroup
from sglang_cpkv.testing.batches import COLLISION
from sglang_cpkv.testing.cp_dist import spawn_cp_ranks


@contextmanager
def _ops_backend(backend: str | None):
    """Force ``SGLANG_CPKV_OPS_BACKEND`` for this process and the ranks it spawns (None: leave it)."""
    if backend is None:
        yield
        return
    previous = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = previous


def _goldens_equal(a: RunTrace, b: RunTrace) -> list[str]:
    problems = []
    for ta, tb in zip(a.requests, b.requests):
        v = compare_request(ta, tb)
        if not v.equal_to_golden:
            problems.append(
                f"request {ta.request}: output positions {v.out_mismatch_positions[:8]}, views {v.dense_mismatches[:2]}"
            )
    return problems


def _batch_check(
    name: str, cp: int, bs: int, rank: int, run: RunTrace, goldens: RunTrace, marker_start, expected_class: str
) -> dict:
    verdicts = judge_run(run, goldens, marker_start)
    class_ok = bs < 2 or run.state_class == expected_class
    unequal = [v.request for v in verdicts if not v.equal_to_golden]
    contaminated = [v.request for v in verdicts if v.contaminated]
    return {
        "check": "batch",
        "scenario": name,
        "cp": cp,
        "bs": bs,
        "rank": rank,
        "state_class": run.state_class,
        "forwards": len(run.forward_classes),
        "requests_equal_to_golden": bs - len(unequal),
        "requests_unequal": unequal,
        "requests_contaminated": contaminated,
        "details": [vars(v) for v in verdicts if not v.equal_to_golden or v.contaminated][:4],
        "passed": not unequal and not contaminated and class_ok,
        **({} if class_ok else {"class_error": f"expected {expected_class}, the page tables give {run.state_class}"}),
    }


def _negative_control_check(name: str, bs: int, run: RunTrace, goldens: RunTrace, marker_start) -> dict:
    verdicts = judge_run(run, goldens, marker_start)
    contaminated = [v.request for v in verdicts if v.contaminated]
    unequal = [v.request for v in verdicts if not v.equal_to_golden]
    if run.state_class == COLLISION:
        expectation, passed = "detects contamination (a request reads another request's marker)", bool(contaminated)
    else:
        expectation, passed = (
            "harmless (identical copies): every request byte-equal to bs=1",
            not unequal and not contaminated,
        )
    example = next((v.foreign_marker_reads[0] | {"request": v.request} for v in verdicts if v.contaminated), None)
    return {
        "check": "negative_control",
        "scenario": name,
        "cp": 1,
        "bs": bs,
        "state_class": run.state_class,
        "expectation": expectation,
        "requests_contaminated": contaminated,
        "requests_unequal": unequal,
        "foreign_marker_reads": sum(len(v.foreign_marker_reads) for v in verdicts),
        "example": example,
        "passed": passed,
    }


def run_harness(
    cp_list: list[int],
    bs_list: list[int],
    scenario_names: list[str],
    device: str = "cpu",
    backend: str | None = None,
    *,
    page_size: int = 4,
    model: ToyDsaConfig | None = None,
    negative_control: bool = True,
    checked: bool = False,
    log=print,
) -> dict:
    """Run the harness; returns the report (``report["summary"]["failed"] == 0`` when everything passed).

    Args:
        cp_list: CP sizes (cp>1 needs that many GPUs on CUDA). bs_list: batch sizes (>= 1).
        scenario_names: names from :data:`~.scenarios.SCENARIO_NAMES`.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL). backend: forces ``SGLANG_CPKV_OPS_BACKEND``.
        negative_control: also run the 1-D value-keyed inverse at cp=1.
        checked: build every plan in checked mode (synchronizes; invariant errors raise).
    """
    unknown = sorted(set(scenario_names) - set(SCENARIO_NAMES))
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; choose from {SCENARIO_NAMES}")
    if not bs_list or min(bs_list) < 1 or not cp_list or min(cp_list) < 1:
        raise ValueError(f"bs_list {bs_list} and cp_list {cp_list} must be non-empty and >= 1")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device == "cuda" and max(cp_list) > torch.cuda.device_count():
        raise ValueError(f"cp={max(cp_list)} needs {max(cp_list)} GPUs, {torch.cuda.device_count()} visible")
    model = model or ToyDsaConfig()
    scenarios = build_scenarios(max(bs_list), page_size)
    job = HarnessJob(model, tuple(scenarios[n] for n in scenario_names), tuple(bs_list), negative_control, checked)
    checks: list[dict] = []
    timings = {}
    backends = set()
    reference_goldens: dict[str, RunTrace] | None = None
    with _ops_backend(backend):
        for cp in cp_list:
            start = time.perf_counter()
            if cp == 1:
                rank_results = [
                    run_job_on_rank(job, SingleRankGroup(), torch.device("cuda:0" if device == "cuda" else "cpu"))
                ]
            else:
                rank_results = [r[0] for r in spawn_cp_ranks(cp, [job], device=device, rank_fn=run_job_on_rank)]
            timings[f"cp{cp}_seconds"] = round(time.perf_counter() - start, 2)
            backends |= {r["backend"] for r in rank_results}
            if reference_goldens is None:
                reference_goldens = rank_results[0]["goldens"]
            for rank, result in enumerate(rank_results):
                for name in scenario_names:
                    if result["goldens"] is not reference_goldens:
                        problems = _goldens_equal(result["goldens"][name], reference_goldens[name])
                        checks.append(
                            {
                                "check": "golden",
                                "scenario": name,
                                "cp": cp,
                                "rank": rank,
                                "problems": problems[:4],
                                "passed": not problems,
                            }
                        )
                    for bs in bs_list:
                        checks.append(
                            _batch_check(
                                name,
                                cp,
                                bs,
                                rank,
                                result["batches"][(name, bs)],
                                result["goldens"][name],
                                scenarios[name].marker_start,
                                scenarios[name].expected_class,
                            )
                        )
                for (name, bs), run in result["negative_control"].items():
                    checks.append(
                        _negative_control_check(name, bs, run, result["goldens"][name], scenarios[name].marker_start)
                    )
            log(
                f"cp={cp}: {timings[f'cp{cp}_seconds']} s, "
                + ", ".join(
                    f"{k}={sum(c['passed'] for c in checks if c['check'] == k and c.get('cp') == cp)}/{sum(1 for c in checks if c['check'] == k and c.get('cp') == cp)}"
                    for k in ("golden", "batch", "negative_control")
                )
            )
    failed = [c for c in checks if not c["passed"]]
    return {
        "device": device_line(device),
        "ops_backends": sorted(backends),
        "cp_list": cp_list,
        "bs_list": bs_list,
        "scenarios": {n: scenarios[n].expected_class for n in scenario_names},
        "page_size": page_size,
        "model": vars(model),
        "checked": checked,
        "timings": timings,
        "summary": summarize(checks, ("golden", "batch", "negative_control")),
        "failures": failed,
        "checks": checks,
    }


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Multi-GPU CP correctness harness: bs>1 vs bs=1 byte equality. --stack serving (default): "
        "upstream's DSA attention kit through the patched backend; --stack toy: a whole-model chunked prefill "
        "through the runtime's pipeline, with the 1-D-inverse negative control."
    )
    parser.add_argument("--stack", choices=("serving", "toy"), default="serving")
    parser.add_argument("--cp", type=_int_list, default=[1, 2], help="comma-separated CP sizes (default 1,2)")
    parser.add_argument(
        "--bs-list", type=_int_list, default=[2, 4, 8], help="comma-separated batch sizes (default 2,4,8)"
    )
    parser.add_argument(
        "--scenarios",
        default="all",
        help=f"comma-separated; serving: {','.join(serving.SCENARIO_NAMES)}; toy: {','.join(SCENARIO_NAMES)} "
        "(default all)",
    )
    parser.add_argument(
        "--routes", default="all", help=f"serving stack, comma-separated from {','.join(serving.ROUTES)} (default all)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dist",
        choices=("nccl", "gloo"),
        default=None,
        help="serving stack: the ranks' collectives (default: NCCL on cuda, one GPU per rank; gloo on cpu; gloo on "
        "cuda puts every rank on GPU 0)",
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help=f"force {BACKEND_ENV} (default: leave the environment)"
    )
    parser.add_argument("--page-size", type=int, default=4, help="toy stack")
    parser.add_argument("--layers", type=int, default=3, help="toy stack")
    parser.add_argument("--topk", type=int, default=8, help="toy stack")
    parser.add_argument("--checked", action="store_true", help="toy stack: checked mode in every plan (synchronizes)")
    parser.add_argument("--no-negative-control", action="store_true", help="toy stack")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    all_scenarios = serving.SCENARIO_NAMES if args.stack == "serving" else SCENARIO_NAMES
    names = list(all_scenarios) if args.scenarios == "all" else [s for s in args.scenarios.split(",") if s]
    if args.device == "cuda" and args.backend in ("cuda", "auto", None):
        # Load (or JIT-build, with SGLANG_CPKV_CUDA_JIT=1) the CUDA ops once here, before the ranks start.
        from sglang_cpkv.ops import cuda as cuda_ops

        start = time.perf_counter()
        print(f"CUDA ops available: {cuda_ops.is_available()} ({time.perf_counter() - start:.1f} s)", flush=True)
    start = time.perf_counter()

    def log(message: str) -> None:
        print(message, flush=True)

    if args.stack == "serving":
        routes = list(serving.ROUTES) if args.routes == "all" else [r for r in args.routes.split(",") if r]
        with _ops_backend(args.backend):
            report = serving.run_serving_harness(
                args.cp, args.bs_list, names, routes, args.device, log=log, dist_backend=args.dist
            )
    else:
        report = run_harness(
            args.cp,
            args.bs_list,
            names,
            args.device,
            args.backend,
            page_size=args.page_size,
            model=ToyDsaConfig(num_layers=args.layers, topk=args.topk),
            negative_control=not args.no_negative_control,
            checked=args.checked,
            log=log,
        )
    report["timings"]["total_seconds"] = round(time.perf_counter() - start, 2)
    report["command"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    summary = report["summary"]
    print(f"checks passed {summary['passed']}/{summary['checks']} {summary['by_kind']}")
    for check in report["checks"]:
        if check["check"] == "negative_control":
            print(
                f"  negative control {check['scenario']} bs={check['bs']} ({check['state_class']}): "
                f"{'PASS' if check['passed'] else 'FAIL'} - {check['expectation']}; "
                f"contaminated requests {check['requests_contaminated']}"
            )
    for failure in report["failures"]:
        print("FAILED:", json.dumps(failure, default=str)[:2000])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0 if summary["failed"] == 0 else 1
