"""Per-layer time of upstream's DSA kit layer (``triton_sparse_mla``) with the CP shared-KV mode off and on.

On one GPU at cp 1, through :class:`sglang_cpkv.testing.dsa_kit.KitWorld` (upstream's kit runner, pools and
backend, the patched ``forward_extend``): a batch of requests with long histories, ``--layers`` layers; the
attention layers of a forward are timed with CUDA events (median of ``--reps`` forwards after a warm-up) with
the mode off, on with the layer-ahead history prefetch, and on with each layer materializing its own history
(``SGLANG_CPKV_LAYER_AHEAD=0``). Needs the GPU test environment (``scripts/gpu_env/install.sh``).

    python benchmark/bench_kit_layer.py [--requests 8 --history 8192 --extend 1024 --layers 4 --fp8] --out r.json

``--heads``/``--topk`` set the layer's shape (default the kit's sparse cases: 4 heads, top-k 128; DeepSeek-V3.2:
128 heads, top-k 2048). ``--profile`` also lists, per configuration, the GPU time of each kernel of one forward
(torch profiler) and the host time of the forward's layer loop, so the mode's added time is attributed.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, kit_capacity


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--fp8", action="store_true", help="the 656-byte FP8 pool (RAGGED route)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time of one forward, per config")
    parser.add_argument("--out", help="write the figures here (json)")
    args = parser.parse_args(argv)
    longest = args.history + args.extend
    shape = (args.requests, longest)
    capacity = kit_capacity(*shape)
    pages = -(-longest // PAGE)
    order = torch.randperm(capacity - 1, generator=torch.Generator().manual_seed(0)).add(1).tolist()
    tables = tuple(tuple(order[r * pages : (r + 1) * pages]) for r in range(args.requests))
    case = BatchCase(PAGE, capacity, tables, (args.history,) * args.requests, (args.extend,) * args.requests)
    route = KitRoute("triton_sparse_mla", fp8=args.fp8, skip_topk_layers=(False,) * args.layers)
    rows = []
    for label, mode_on, layer_ahead in (
        ("mode off", False, "1"),
        ("mode on, layer-ahead", True, "1"),
        ("mode on, synchronous", True, "0"),
    ):
        os.environ["SGLANG_CPKV_LAYER_AHEAD"] = layer_ahead
        world = KitWorld(
            route,
            max_requests=shape[0],
            longest=shape[1],
            mode_on=mode_on,
            device="cuda",
            heads=args.heads,
            topk=args.topk,
        )
        world.write_history(case)
        plan_ms, layer_ms = world.time_layers(case, args.reps)
        rows.append({"config": label, "plan_ms": plan_ms, "layer_ms": layer_ms})
        if args.profile:
            rows[-1]["kernels"] = _profile(world, case)
        del world
        torch.cuda.empty_cache()
    base = rows[0]["layer_ms"]
    print(
        f"kit layer, triton_sparse_mla, {'FP8 656-byte' if args.fp8 else 'bf16'} pool: {args.requests} requests x "
        f"{args.history} history + {args.extend} extend, {args.layers} layers, {args.heads} heads, top-k "
        f"{args.topk}, median of {args.reps}"
    )
    for row in rows:
        row["vs_off"] = row["layer_ms"] / base
        print(
            f"  {row['config']:24s} plan {row['plan_ms']:8.3f} ms   per layer {row['layer_ms']:8.3f} ms   x{row['vs_off']:.3f}"
        )
    for row in rows if args.profile else []:
        print(f"  {row['config']}: GPU us per forward by kernel (top 12 of {len(row['kernels'])})")
        for name, us in sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {us:10.1f}  {name[:110]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


def _profile(world: KitWorld, case: BatchCase) -> dict[str, float]:
    """GPU microseconds per kernel name over one forward's attention layers (``time_layers`` with one rep, after
    its warm-up forward), and the forward's host time under ``"host: layer loop"``."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        world.time_layers(case, 1)
        host_us = (time.perf_counter() - start) * 1e6
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            kernels[event.key] = event.device_time_total / 2  # time_layers runs a warm-up forward and one timed
    kernels["host: two forwards (wall)"] = host_us
    return kernels


if __name__ == "__main__":
    raise SystemExit(main())
