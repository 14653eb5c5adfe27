"""Where the CP shared-KV plan hook spends its host time, phase by phase, through upstream's real objects.

For each request count a :class:`~sglang_cpkv.testing.dsa_kit.KitWorld` with the mode off and one with it on
(synchronous history) run upstream's ``init_forward_metadata`` (the plan hook inside it) on a batch of ``--history`` +
``--extend`` tokens per request. With the mode on, the hook and the functions it calls (:data:`PHASES`) are timed with
``time.perf_counter`` around each call; the device is synchronized as the hook starts (timed apart, as the wait for
the device work upstream queued before it), so that no phase is charged the wait of the page table's one host read.
Reported: the median per call of each phase over ``--reps`` calls after three warm-up calls, and the whole call's host
time and CUDA-event window for both configurations. A diagnostic: the phases overlap (a phase's time includes the
phases it calls), and the timers add a few microseconds each.

``--device cpu`` runs the same hook on the CPU (``triton_sparse_mla``, bf16 pool: the flashmla routes need a GPU): the
device ops are the torch reference there, so only the host phases around them mean anything, measured as they run in
place (cold caches after upstream's work and the previous call's ops), which is how they run on the GPU's host.

    python benchmark/plan_host_phases.py [--requests 1,8,64 --history 8192 --extend 1024 --backend flashmla_kv] \\
        [--device cpu] --out phases.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import sglang_cpkv.hooks.dsa_batch as dsa_batch
import sglang_cpkv.hooks.dsa_metadata as dsa_metadata
import sglang_cpkv.runtime.plan as plan
from sglang_cpkv.runtime.reservation import Reservation
from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, distinct_page_tables, kit_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kit_timing, a sibling module
from kit_timing import timed_metadata

WAIT = "wait for upstream's queued device work"
# (owner, attribute, label): the hook, what it calls, and the plan's steps.
PHASES = (
    (dsa_metadata, "on_extend_metadata", "hook"),
    (dsa_metadata, "pool_page_table", "hook / pool_page_table"),
    (dsa_metadata, "build_plan", "hook / build_plan"),
    (Reservation, "check_batch", "hook / check_batch"),
    (dsa_batch.BackendState, "begin", "hook / begin"),
    (dsa_metadata, "remap_page_table", "hook / remap_page_table"),
    (dsa_batch.BackendState, "surface_errors", "begin / surface_errors"),
    (dsa_batch, "_ErrorsInTransit", "begin / error counter to the host"),
    (dsa_batch, "LayerPipeline", "begin / LayerPipeline"),
    (plan, "_validate_lengths", "build_plan / _validate_lengths"),
    (plan, "_pages_needed", "build_plan / _pages_needed"),
    (torch.Tensor, "cpu", "build_plan / Tensor.cpu (the page table's host read)"),
    (plan, "_BatchLayout", "build_plan / _BatchLayout (the layout in numpy)"),
    (plan.PlanStaging, "stage", "build_plan / PlanStaging.stage"),
    (plan.ops, "build_page_inverse", "build_plan / build_page_inverse"),
    (plan.ops, "current_dense_locs", "build_plan / current_dense_locs"),
    (plan, "_owned_cache_write_locs", "build_plan / _owned_cache_write_locs"),
)


def _instrument(times: dict[str, list[float]]) -> None:
    for owner, name, label in PHASES:
        if not hasattr(owner, name):
            raise SystemExit(f"{owner.__name__} has no {name}: update PHASES to the plan hook's functions")
        real = getattr(owner, name)

        def timed(*args, _real=real, _label=label, **kwargs):
            if _label == "hook" and torch.cuda.is_initialized():
                start = time.perf_counter()
                torch.cuda.synchronize()
                times.setdefault(WAIT, []).append(time.perf_counter() - start)
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                times.setdefault(_label, []).append(time.perf_counter() - start)

        setattr(owner, name, functools.wraps(real)(timed))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 64])
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--backend", default="flashmla_kv", help="the DSA prefill backend (flashmla_* need flash_mla)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="write the figures here (json)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (--device cpu: the host phases around the reference ops)")
    route = KitRoute(args.backend, fp8=True) if args.device == "cuda" else KitRoute("triton_sparse_mla", fp8=False)
    times: dict[str, list[float]] = {}
    _instrument(times)
    results = {}
    for requests in args.requests:
        longest = args.history + args.extend
        capacity = kit_capacity(requests, longest)
        tables = distinct_page_tables([longest] * requests, capacity, seed=0)
        case = BatchCase(PAGE, capacity, tables, (args.history,) * requests, (args.extend,) * requests)
        for config, mode_on in (("mode off", False), ("mode on, synchronous", True)):
            os.environ["SGLANG_CPKV_LAYER_AHEAD"] = "0"
            world = KitWorld(route, max_requests=requests, longest=longest, mode_on=mode_on, device=args.device)
            forward_batch = world._extend_batch(case)[0]
            world.make_current()
            host, window = [], []
            with torch.no_grad():
                for call in range(args.reps + 3):
                    if call == 3:
                        times.clear()
                    host_ms, window_ms = timed_metadata(world, forward_batch)
                    host.append(host_ms)
                    window.append(window_ms)
            phases = {label: statistics.median(v) * 1e3 for label, v in times.items()} if mode_on else {}
            results[f"{requests} requests, {config}"] = {
                "host_ms": statistics.median(host[3:]),
                "device_window_ms": None if window[0] is None else statistics.median(window[3:]),
                "phases_ms": phases,
            }
            times.clear()
            del world, forward_batch
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(
        f"init_forward_metadata, {route.prefill_backend}, {'FP8' if route.fp8 else 'bf16'} pool, {args.device}: requests x "
        f"({args.history} + {args.extend}), "
        f"median of {args.reps} calls; phases (ms per call) with the mode on"
    )
    for name, row in results.items():
        window = "" if row["device_window_ms"] is None else f"  device window {row['device_window_ms']:7.3f} ms"
        print(f"  {name:32s} host {row['host_ms']:7.3f} ms{window}")
        for label, ms in row["phases_ms"].items():
            print(f"      {ms:7.3f}  {label}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
