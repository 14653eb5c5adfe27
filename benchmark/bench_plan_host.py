"""The host cost of the CP shared-KV mode's per-batch plan, by request count, through upstream's real objects.

The plan is what the mode adds to upstream's ``init_forward_metadata`` (the DSA backend's per-batch metadata, with
the mode's hook inside it: the plan, the batch's pipeline, the remapped tables). For each request count a
:class:`~sglang_cpkv.testing.dsa_kit.KitWorld` (upstream's kit runner, pools and backend) per configuration (mode off,
mode on with the layer-ahead history, mode on synchronous) runs ``init_forward_metadata`` on a batch of ``--history`` +
``--extend`` tokens per request. The configurations take turns call by call in one process (each call is made the
process's configuration first: the flag and the reservation are process-wide), so a drift of the host's speed
reaches all of them alike; each is timed with ``time.perf_counter`` around the call, the device synchronized before
the clock starts, and, on a GPU, with CUDA events over the same window. Reported: each configuration's median host
time and the median over rounds of its difference from mode off in the same round (the increment). ``--profile``
adds, for each configuration, the functions of ``sglang_cpkv`` and the torch calls that take the most host time
(cProfile).

    python benchmark/bench_plan_host.py --device cuda [--requests 1,8,16,32,64 --history 8192 --extend 1024] \\
        [--backend flashmla_kv --fp8] [--profile] --out plan.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

import torch

from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, distinct_page_tables, kit_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kit_timing, a sibling module
from kit_timing import timed_metadata

CONFIGS = (("mode off", False, "0"), ("mode on, layer-ahead", True, "1"), ("mode on, synchronous", True, "0"))


def _profile(world: KitWorld, forward_batch, reps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        world.backend.init_forward_metadata(forward_batch)
    if world.device.type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(r"sglang_cpkv|torch|built-in", 25)
    stats.sort_stats("cumulative").print_stats(r"sglang_cpkv", 25)
    # The host time of each torch op (cProfile charges tensor indexing to its caller), and the ops per call.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        for _ in range(reps):
            world.backend.init_forward_metadata(forward_batch)
    top = [e for e in trace.events() if e.cpu_parent is None and e.name.startswith(("aten::", "cuda", "sglang_cpkv"))]
    out.write(f"\ntop-level torch ops per call: {len(top) / reps:.0f}\n")
    out.write(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 16, 32, 64])
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--backend", default="flashmla_kv", help="the DSA prefill backend (flashmla_* need flash_mla)")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="the 656-byte FP8 pool")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="cProfile of the mode-on calls (top host costs)")
    parser.add_argument("--out", help="write the figures here (json)")
    args = parser.parse_args(argv)
    route = KitRoute(args.backend, fp8=args.fp8)
    rows, profiles = [], {}
    for requests in args.requests:
        longest = args.history + args.extend
        capacity = kit_capacity(requests, longest)
        tables = distinct_page_tables([longest] * requests, capacity, seed=0)
        case = BatchCase(PAGE, capacity, tables, (args.history,) * requests, (args.extend,) * requests)
        worlds = []
        for label, mode_on, layer_ahead in CONFIGS:
            os.environ["SGLANG_CPKV_LAYER_AHEAD"] = layer_ahead
            world = KitWorld(route, max_requests=requests, longest=longest, mode_on=mode_on, device=args.device)
            worlds.append((label, world, world._extend_batch(case)[0]))
        times: dict[str, list[tuple[float, float | None]]] = {label: [] for label, *_ in worlds}
        with torch.no_grad():
            for round_ in range(args.reps + 2):  # two warm-up rounds; the order turns each round
                for label, world, forward_batch in worlds[round_ % 3 :] + worlds[: round_ % 3]:
                    world.make_current()
                    times[label].append(timed_metadata(world, forward_batch))
            if args.profile:
                for label, world, forward_batch in worlds:
                    world.make_current()
                    with world.up["context"](world.backend):
                        profiles[f"{requests} requests, {label}"] = _profile(world, forward_batch, args.reps)
        off = [host for host, _ in times["mode off"][2:]]
        for label, *_ in worlds:
            host = [h for h, _ in times[label][2:]]
            device = [d for _, d in times[label][2:]]
            rows.append(
                {
                    "requests": requests,
                    "config": label,
                    "host_ms": statistics.median(host),
                    "device_ms": None if device[0] is None else statistics.median(device),
                    "host_minus_off_ms": statistics.median(h - o for h, o in zip(host, off)),
                }
            )
        del worlds
    print(
        f"init_forward_metadata, {args.backend}, {'FP8' if args.fp8 else 'bf16'} pool, {args.device}: requests x "
        f"({args.history} history + {args.extend} extend), median of {args.reps}"
    )
    for row in rows:
        device = "" if row["device_ms"] is None else f"  device window {row['device_ms']:7.3f} ms"
        print(
            f"  {row['requests']:3d} requests  {row['config']:21s} host {row['host_ms']:7.3f} ms "
            f"(+{row['host_minus_off_ms']:.3f}){device}"
        )
    for name, text in profiles.items():
        print(f"\n--- {name}\n{text}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "profiles": profiles}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
