"""The forward time of upstream's DSA kit layers with the CP shared-KV mode off and on, with the route's real kernel.

Through :class:`sglang_cpkv.testing.dsa_kit.KitWorld` (upstream's kit runner, pools and backend, the patched
``forward_extend``): a batch of requests with long histories, ``--layers`` kit layers; per configuration - the mode
off, on with the layer-ahead history prefetch, on with each layer materializing its own history
(``SGLANG_CPKV_LAYER_AHEAD=0``) - CUDA events time the plan (upstream's ``init_forward_metadata``, the mode's plan
inside it) and the layer loop (attention only; inputs prepared before the clock starts) of ``--reps`` forwards after
a warm-up. The three configurations take turns forward by forward in one process (the order turns each round), so a
drift of the GPU's or the host's speed reaches them alike: each time is the median over the rounds, and each ratio
(difference) to mode off the median of the same-round ratios (differences). The figure that matters is the **forward**: the plan, the first layer and
``--model-layers`` (78, GLM-5.1) - 1 times the mean of the later timed layers, since the plan runs once per batch and a
layer once per model layer, and the first layer's window also holds the device's wait for the host to issue it after
the plan (once per forward; counting it in every layer would charge it 78 times). Needs the GPU test
environment (``scripts/gpu_env/install.sh``; the ``flashmla_*`` backends need its ``flash_mla`` library).

    python benchmark/bench_kit_layer.py --backend flashmla_kv --fp8 --heads 64 --topk 2048 --requests 8 \\
        --history 8192,32768,131072 --extend 1024 --sharing distinct,shared --processes 3 --out r.json

``--history`` and ``--sharing`` are sweeps (``shared``: every request on one shared prompt of ``--history`` tokens, a
radix hit, and pages of its own for the current tokens). ``--processes N`` runs the whole sweep in N fresh
processes, one after the other, and reports each figure's median with its spread over them (min-max), so a ratio is
quoted no finer than the runs resolve. ``--cp N`` runs N ranks, one process per GPU (upstream's distributed init
over NCCL, the patched model-parallel groups, the mode's exchange group): each layer's clock then also covers
upstream's all-gather of the current KV beside the mode's history exchange; a layer's time is its slowest rank's.
``--profile`` also lists, per configuration, the GPU time of each kernel of one forward (torch profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, distinct_page_tables, kit_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kit_timing, a sibling module
from kit_timing import prepare_timing, time_layers, timed_forward

CONFIGS = (("mode off", False, "1"), ("mode on, layer-ahead", True, "1"), ("mode on, synchronous", True, "0"))
BACKENDS = ("triton_sparse_mla", "flashmla_sparse", "flashmla_kv", "flashmla_auto")
SHARING = ("distinct", "shared")


def _case(args, history: int, cp: int, shared: bool) -> BatchCase:
    """``--requests`` requests of ``history`` + ``--extend`` tokens on distinct pages, or (``shared``) all on the
    first request's history pages (one shared prompt, a radix hit: history page-aligned) and pages of their own for
    the current tokens."""
    longest = history + args.extend
    capacity = kit_capacity(args.requests, longest, cp)
    tables = distinct_page_tables([longest] * args.requests, capacity, seed=0, cp_size=cp)
    if shared:
        if history % PAGE:
            raise SystemExit(f"--sharing shared needs a page-aligned --history (multiple of {PAGE}), got {history}")
        prompt = tables[0][: history // PAGE]
        tables = tuple(prompt + table[history // PAGE :] for table in tables)
    return BatchCase(PAGE, capacity, tables, (history,) * args.requests, (args.extend,) * args.requests, cp)


def measure(args, cp: int = 1, rank: int = 0, model_dir: str = "") -> list[dict]:
    """Every configuration at every history length and sharing on this rank: a kit world per configuration, the
    configurations taking turns forward by forward (the order turns each round), so that a drift of the GPU's or
    the host's speed reaches them alike. Each row holds its configuration's ``rounds``: ``(plan ms, first layer ms,
    later layers' mean ms)`` of each timed forward, round by round."""
    from sglang_cpkv.testing.dsa_kit import publish_prefill_cp_server_args

    route = KitRoute(args.backend, fp8=args.fp8, skip_topk_layers=(False,) * args.layers)
    rows = []
    for history in args.history:
        for sharing in args.sharing:
            case = _case(args, history, cp, sharing == "shared")
            worlds = []
            for label, mode_on, layer_ahead in CONFIGS:
                os.environ["SGLANG_CPKV_LAYER_AHEAD"] = layer_ahead  # read once, into the world's reservation
                if cp > 1:
                    publish_prefill_cp_server_args(model_dir, cp, mode_on=mode_on)
                world = KitWorld(
                    route,
                    max_requests=args.requests,
                    longest=history + args.extend,
                    mode_on=mode_on,
                    device=torch.cuda.current_device(),
                    cp_size=cp,
                    cp_rank=rank,
                    heads=args.heads,
                    topk=args.topk,
                )
                world.write_history(case)
                worlds.append((label, mode_on, world, prepare_timing(world, case)))
            rounds: dict[str, list[tuple[float, float, float]]] = {label: [] for label, *_ in worlds}
            for round_ in range(args.reps + 1):  # the first round warms every kernel and buffer
                for label, mode_on, world, timing in worlds[round_ % 3 :] + worlds[: round_ % 3]:
                    if cp > 1:
                        publish_prefill_cp_server_args(model_dir, cp, mode_on=mode_on)
                    world.make_current()
                    timed = timed_forward(world, timing)
                    rounds[label].append((timed.plan_ms, timed.layer_ms[0], timed.later_layer_ms))
            for label, _, world, _ in worlds:
                row = {"history": history, "sharing": sharing, "config": label, "rounds": rounds[label][1:]}
                rows.append(dict(row, kernel=world.backend.dsa_prefill_impl))
                if args.profile:
                    world.make_current()
                    rows[-1]["kernels"] = _profile(world, case)
            del worlds
            torch.cuda.empty_cache()
    return rows


def _rank(rank: int, args, model_dir: str) -> None:
    """One CP rank on GPU ``rank``: upstream's distributed init (NCCL), the patched groups, then every config."""
    from sglang_cpkv.testing.dsa_kit import init_cp_rank

    init_cp_rank(rank, args.cp, "cuda", Path(model_dir, "dist_init").as_uri(), model_dir)
    Path(model_dir, f"rank{rank}.json").write_text(json.dumps(measure(args, args.cp, rank, model_dir)))


def _one_process(args) -> list[dict]:
    """The sweep in this process (cp 1) or in ``--cp`` spawned ranks, each row with its forward figure."""
    if args.cp == 1:
        rows = measure(args)
    else:
        import torch.multiprocessing as mp

        from sglang_cpkv.testing.dsa_kit import write_dsa_model_dir

        with tempfile.TemporaryDirectory() as tmp:
            write_dsa_model_dir(tmp)
            mp.spawn(_rank, args=(args, tmp), nprocs=args.cp, join=True)
            per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.cp)]
        # The critical path of a layer is its slowest rank's.
        # A round's plan and layer are its slowest rank's (the critical path).
        rows = [
            dict(row, rounds=[tuple(map(max, zip(*ranks))) for ranks in zip(*(r[i]["rounds"] for r in per_rank))])
            for i, row in enumerate(per_rank[0])
        ]
    for row in rows:
        off = next(r for r in rows if _key(r)[:2] == _key(row)[:2] and r["config"] == "mode off")
        mine, theirs = row["rounds"], off["rounds"]
        forward = [plan + first + (args.model_layers - 1) * later for plan, first, later in mine]
        forward_off = [plan + first + (args.model_layers - 1) * later for plan, first, later in theirs]
        row["plan_ms"] = statistics.median(plan for plan, _, _ in mine)
        row["first_layer_ms"] = statistics.median(first for _, first, _ in mine)
        row["layer_ms"] = statistics.median(later for _, _, later in mine)
        row["forward_ms"] = statistics.median(forward)
        # Ratios and differences to mode off: medians of the same round's.
        row["forward_vs_off"] = statistics.median(f / o for f, o in zip(forward, forward_off))
        row["layer_vs_off"] = statistics.median(m[2] / o[2] for m, o in zip(mine, theirs))
        row["plan_minus_off_ms"] = statistics.median(m[0] - o[0] for m, o in zip(mine, theirs))
    return rows


def _key(row: dict) -> tuple:
    return row["history"], row["sharing"], row["config"]


def _summary(processes: list[list[dict]]) -> list[dict]:
    """Per configuration: the median over the processes of each figure, and the spread (min, max) of each."""
    out = []
    for i, first in enumerate(processes[0]):
        runs = [rows[i] for rows in processes]
        assert all(_key(r) == _key(first) for r in runs), "the processes measured different sweeps"
        row = {k: first[k] for k in ("history", "sharing", "config", "kernel", "kernels") if k in first}
        for name in (
            "plan_ms",
            "first_layer_ms",
            "layer_ms",
            "forward_ms",
            "forward_vs_off",
            "layer_vs_off",
            "plan_minus_off_ms",
        ):
            values = [r[name] for r in runs]
            row[name] = statistics.median(values)
            row[name + "_spread"] = [min(values), max(values)]
        out.append(row)
    return out


def _print(args, summary: list[dict], processes: int) -> None:
    print(
        f"kit layers, {args.backend}, {'FP8 656-byte' if args.fp8 else 'bf16'} pool, cp {args.cp}: {args.requests} "
        f"requests x history + {args.extend} extend, {args.layers} layers timed, {args.heads} heads, top-k "
        f"{args.topk}; forward = plan + first layer + {args.model_layers - 1} x later layer; median of {args.reps} forwards per process"
        + (f", median [min-max] over {processes} processes" if processes > 1 else "")
        + (", the slowest rank's" if args.cp > 1 else "")
    )
    for row in summary:
        lo, hi = row["forward_vs_off_spread"]
        print(
            f"  history {row['history']:6d} {row['sharing']:8s} {row['config']:21s} ({row['kernel']}) "
            f"plan {row['plan_ms']:7.3f} ms  first {row['first_layer_ms']:7.3f} ms  later {row['layer_ms']:7.3f} ms  forward {row['forward_ms']:8.2f} ms  "
            f"x{row['forward_vs_off']:.4f} [{lo:.4f}-{hi:.4f}]  plan +{row['plan_minus_off_ms']:.3f} ms"
        )
    for row in summary if args.profile else []:
        print(f"  {row['config']}: GPU us per forward by kernel (top 12 of {len(row['kernels'])})")
        for name, us in sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {us:10.1f}  {name[:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, default="triton_sparse_mla", help="the DSA prefill backend")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--history", type=lambda t: [int(x) for x in t.split(",")], default=[8192], help="sweep")
    parser.add_argument("--sharing", type=lambda t: t.split(","), default=["distinct"], help="distinct,shared")
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4, help="kit layers timed (at least 2)")
    parser.add_argument("--model-layers", type=int, default=78, help="layers of the model (GLM-5.1: 78)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--fp8", action="store_true", help="the 656-byte FP8 pool")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--cp", type=int, default=1, help="CP ranks, one process per GPU over NCCL")
    parser.add_argument("--processes", type=int, default=1, help="run the sweep in this many fresh processes")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time of one forward, per config")
    parser.add_argument("--out", help="write the figures here (json)")
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error("--layers must be >= 2: the later layers' mean is the steady layer time")
    if args.cp > torch.cuda.device_count():
        parser.error(f"--cp {args.cp} needs {args.cp} GPUs, {torch.cuda.device_count()} visible")
    bad = sorted(set(args.sharing) - set(SHARING))
    if bad:
        parser.error(f"--sharing {bad}: choose from {SHARING}")
    if args.processes < 1 or (args.processes > 1 and args.profile):
        parser.error("--processes must be >= 1, and 1 with --profile")
    if args.processes == 1:
        processes = [_one_process(args)]
    else:
        own = list(sys.argv[1:] if argv is None else argv)
        processes = []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.processes):
                out = Path(tmp, f"process{i}.json")
                cmd = [sys.executable, __file__, *_without(own, "--processes", "--out"), "--out", str(out)]
                print(f"process {i + 1}/{args.processes}: {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, check=True)
                processes.append(json.loads(out.read_text())["processes"][0])
    summary = _summary(processes)
    _print(args, summary, len(processes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "processes": processes}, f, indent=1)
    return 0


def _without(argv: list[str], *options: str) -> list[str]:
    """``argv`` without the given options and their values (``--x v`` or ``--x=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not any(arg.startswith(o + "=") for o in options):
            out.append(arg)
    return out


def _profile(world: KitWorld, case: BatchCase) -> dict[str, float]:
    """GPU microseconds per kernel name over one forward's attention layers (``time_layers`` with one rep, after
    its warm-up forward), and the forward's host time under ``"host: layer loop"``."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        time_layers(world, case, 1)
        host_us = (time.perf_counter() - start) * 1e6
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            kernels[event.key] = event.device_time_total / 2  # time_layers runs a warm-up forward and one timed
    kernels["host: two forwards (wall)"] = host_us
    return kernels


if __name__ == "__main__":
    raise SystemExit(main())
