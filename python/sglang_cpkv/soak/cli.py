"""``python -m sglang_cpkv.soak``: run the soak's scenarios and write its report.

    python -m sglang_cpkv.soak --ci --out soak.json                 # the CI soak (make test runs it)
    python -m sglang_cpkv.soak --minutes 60 --cp 1,2,4 --out s.json # a long soak: scenarios and seeds in turn
    python -m sglang_cpkv.soak --gpu --device cuda --out g.json     # the GPU soak: the real attention kernels

A scenario is one P/D deployment (:class:`~.server.ServerConfig`) serving one seeded workload
(:class:`~.workload.WorkloadConfig`): upstream's bootstrap server, the prefill CP ranks (:mod:`.prefill`, gloo
between them), the decode (:mod:`.decode`), reports gathered by :mod:`.report` (``docs/design/cp-shared-kv-soak.md``).
Exit status: 0 all passed, 1 a mismatch, leak, crash or request that did not end as the workload says, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from sglang_cpkv.soak import report as soak_report
from sglang_cpkv.soak.server import ServerConfig, write_model_dir
from sglang_cpkv.soak.workload import WorkloadConfig


# A scenario's processes give up after this long (a stalled server is caught sooner, by the stall detector): at least
# 30 minutes, and 4 s a request, so that a long scenario on a 2-core machine shared with other work is not cut short.
def time_limit_s(workload: WorkloadConfig) -> float:
    return max(1800.0, 4.0 * workload.requests)


CRASH_GRACE_S = 10


def _role_rank(name: str) -> tuple[str, int]:
    role = name.rstrip("0123456789")
    return role, int(name[len(role) :] or 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ci_scenarios() -> list[tuple[ServerConfig, WorkloadConfig]]:
    """The CI soak (``make test``): cp 1 with the radix cache off, a chunk that is not a page multiple and bf16; cp 2
    with FP8, the radix cache and HiCache host offload in a pool small enough that it evicts and pages load back, and
    the mode's limit at its least (one request of a 1,024-token context), so that admission defers; the transfer,
    ``ignore_eos`` and aborts of every kind in both. Fixed seeds: the first one's workload holds requests that a
    chunk of 200 tokens cuts and whose client aborts them mid-chunk."""
    return [
        (
            ServerConfig(cp=1, chunked_prefill_size=200, radix_cache=False, fp8=False),
            WorkloadConfig(requests=30, seed=11, median_message=40, max_prompt=900),
        ),
        (
            ServerConfig(
                cp=2,
                chunked_prefill_size=256,
                fp8=True,
                prefill_backend="flashmla_kv",
                hicache=True,
                kv_budget_mib=4,
                context_length=1024,
                max_batch_tokens=1024,
            ),
            WorkloadConfig(requests=40, seed=2, median_message=48, max_prompt=600, new_conversation=0.3),
        ),
    ]


def gpu_scenarios() -> list[tuple[ServerConfig, WorkloadConfig]]:
    """The GPU soak (``--gpu``): the real attention kernels of every Hopper prefill route of the mode in place of the
    stand-in's captured reads, each query row's output checked against the function (zero queries: the mean of the
    rows it reads); cp 1 only (two ranks cannot share one GPU: upstream's model-parallel groups open NCCL
    communicators, which refuse two ranks on one device; the lent GPU machines have one), the radix cache on; upstream's
    fake transfer backend and no decode (Mooncake's CUDA engine cannot be installed on the GPU machines: the CPU soak
    proves the transfer). One seed."""
    routes = (
        (1, "flashmla_sparse", False, 256),
        (1, "flashmla_kv", True, 200),
        (1, "flashmla_sparse", True, 320),  # FP8 RAGGED: the dequantized rows
        (1, "triton_sparse_mla", False, 136),
    )
    return [
        (
            # FlashMLA's sparse prefill reads top-k in blocks of 128 (it asserts topk % 128 == 0 on an H100)
            ServerConfig(
                cp=cp, prefill_backend=backend, fp8=fp8, chunked_prefill_size=chunk, transfer_backend="fake", topk=128
            ),
            WorkloadConfig(requests=GPU_REQUESTS, seed=21, median_message=32, max_prompt=1200),
        )
        for cp, backend, fp8, chunk in routes
    ]


GPU_REQUESTS = 100


# Requests per scenario of the long soak, by cp: four rounds of the matrix (every route at every cp) pass 10,000
# requests with 2,000 at each cp. cp 2 takes the most: on a 2-core machine its two ranks run a request fastest.
LONG_REQUESTS = {1: 550, 2: 1500, 4: 550, 8: 400}


def long_scenarios(cps: list[int], seed: int, first_round: int = 0) -> Iterator[tuple[ServerConfig, WorkloadConfig]]:
    """The long soak's matrix, round after round with new seeds: every cp with each prefill route and pool format
    (one route a round), and across a round's scenarios the radix cache on and off (so every route runs with both),
    HiCache on every fourth scenario with the radix cache, chunks that are and are not page multiples, the overlap
    scheduler every third round."""
    routes = (
        ("flashmla_sparse", False),
        ("flashmla_kv", True),
        ("triton_sparse_mla", False),
        ("flashmla_sparse", True),
    )
    for round_ in itertools.count(first_round):
        for index, cp in enumerate(cps):
            backend, fp8 = routes[round_ % len(routes)]
            scenario = round_ * len(cps) + index
            radix = scenario % 2 == 0
            server = ServerConfig(
                cp=cp,
                prefill_backend=backend,
                fp8=fp8,
                radix_cache=radix,
                hicache=radix and scenario % 4 == 0,
                chunked_prefill_size=(200, 256, 320, 136)[(round_ + cp) % 4],
                overlap=round_ % 3 == 1,
            )
            workload = WorkloadConfig(requests=LONG_REQUESTS[cp], seed=seed, median_message=24, max_prompt=1200)
            yield server, workload
            seed += 1


def run_scenario(server: ServerConfig, workload: WorkloadConfig, *, device: str, workdir: Path) -> dict:
    """One scenario in fresh processes (prefill ranks and the decode); its report."""
    from sglang_cpkv.soak.decode import DecodeJob, run_decode
    from sglang_cpkv.soak.prefill import RankJob, run_prefill_rank
    from sglang_cpkv.soak.server import PROCESS_ENV

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model_dir(workdir / "model")
    port = _free_port()
    os.environ.update(PROCESS_ENV)
    with_decode = server.transfer_backend == "mooncake"
    bootstrap = _bootstrap_server(port)
    ctx = mp.get_context("spawn")
    to_decode, results = (ctx.Queue() if with_decode else None), ctx.Queue()
    procs = []
    for rank in range(server.cp):
        job = RankJob(
            server,
            workload,
            rank,
            model_dir,
            port,
            f"file://{workdir}/prefill_init_{port}",
            device=device,
            max_seconds=time_limit_s(workload),
        )
        procs.append(ctx.Process(target=run_prefill_rank, args=(job, to_decode, results), name=f"prefill{rank}"))
    if with_decode:
        decode_job = DecodeJob(
            server,
            workload,
            model_dir,
            port,
            f"file://{workdir}/decode_init_{port}",
            device=device,
            max_seconds=time_limit_s(workload),
        )
        procs.append(ctx.Process(target=run_decode, args=(decode_job, to_decode, results), name="decode"))
    start = time.monotonic()
    for proc in procs:
        proc.start()
    reports: list[dict] = []
    crashed_at = None
    try:
        while len(reports) < len(procs):
            try:
                reports.append(results.get(timeout=2))
                if "crash" in reports[-1] and crashed_at is None:
                    crashed_at = time.monotonic()  # the others are left a moment to report, then stopped
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                late = crashed_at is not None and time.monotonic() - crashed_at > CRASH_GRACE_S
                if dead or late or time.monotonic() - start > time_limit_s(workload) + 120:
                    reported = {(r.get("role"), r.get("rank")) for r in reports}
                    reports += [
                        {"role": p.name, "crash": f"stopped: no report (exit code {p.exitcode})"}
                        for p in procs
                        if _role_rank(p.name) not in reported
                    ]
                    break
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        bootstrap.close()
    return soak_report.scenario(server, workload, reports, time.monotonic() - start)


def _bootstrap_server(port: int):
    """Upstream's Mooncake bootstrap server on loopback (what the prefill server's HTTP process starts)."""
    from sglang_cpkv.testing import dsa_kit

    dsa_kit._upstream()
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

    return MooncakeKVBootstrapServer("127.0.0.1", port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_cpkv.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="the CI soak: fixed seed, cp 1 and cp 2, about 3 minutes")
    parser.add_argument("--gpu", action="store_true", help="the GPU soak: the real attention kernels (--device cuda)")
    parser.add_argument("--minutes", type=float, help="a long soak: run the matrix until this many minutes passed")
    parser.add_argument("--scenarios", type=int, help="a long soak: stop after this many scenarios (default: none)")
    parser.add_argument("--round", type=int, default=0, help="a long soak: the matrix's first round (default 0)")
    parser.add_argument("--cp", default="1,2,4", help="CP sizes of the long soak (default 1,2,4)")
    parser.add_argument("--seed", type=int, default=1, help="the long soak's first seed (the CI soak's are fixed)")
    parser.add_argument("--requests", type=int, help="requests per scenario (default: the scenario's)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the stand-in model's pools on the GPU)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if [args.ci, args.gpu, args.minutes is not None].count(True) != 1:
        parser.error("give exactly one of --ci, --gpu and --minutes")
    if args.gpu and args.device != "cuda":
        parser.error("--gpu runs the real kernels: give --device cuda")
    try:
        cps = [int(x) for x in args.cp.split(",")]
    except ValueError:
        parser.error(f"--cp {args.cp!r}: expected comma-separated integers")
    if any(cp not in (1, 2, 4, 8) for cp in cps):
        parser.error(f"--cp {args.cp!r}: each CP size must be 1, 2, 4 or 8")
    os.environ.setdefault("TRITON_INTERPRET", "0" if args.device == "cuda" else "1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cpkv-soak-"))
    if (args.scenarios is not None and args.scenarios < 1) or args.round < 0:
        parser.error("--scenarios must be at least 1 and --round at least 0")
    if args.ci:
        scenarios = ci_scenarios()
    elif args.gpu:
        scenarios = gpu_scenarios()
    else:
        scenarios = long_scenarios(cps, args.seed, args.round)
    deadline = None if args.minutes is None else time.monotonic() + args.minutes * 60
    reports = []
    for i, (server, workload) in enumerate(scenarios):
        if (deadline is not None and time.monotonic() > deadline) or (
            args.scenarios is not None and i >= args.scenarios
        ):
            break
        if args.requests:
            workload = replace(workload, requests=args.requests)
        print(f"[soak] scenario {i}: {soak_report.label(server, workload)}", flush=True)
        result = run_scenario(server, workload, device=args.device, workdir=workdir / f"s{i}")
        print(f"[soak]   {soak_report.summary_line(result)}", flush=True)
        reports.append(result)
        args.out.write_text(json.dumps(soak_report.whole(reports), indent=1))
    whole = soak_report.whole(reports)
    args.out.write_text(json.dumps(whole, indent=1))
    print(f"[soak] {soak_report.summary_line(whole['totals'])}; report: {args.out}", flush=True)
    return 0 if whole["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
