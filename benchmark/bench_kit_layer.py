"""Per-layer time of upstream's DSA kit layer (``triton_sparse_mla``) with the CP shared-KV mode off and on.

Through :class:`sglang_cpkv.testing.dsa_kit.KitWorld` (upstream's kit runner, pools and backend, the patched
``forward_extend``): a batch of requests with long histories, ``--layers`` layers; the attention layers of a
forward are timed with CUDA events (median of ``--reps`` forwards after a warm-up) with the mode off, on with the
layer-ahead history prefetch, and on with each layer materializing its own history (``SGLANG_CPKV_LAYER_AHEAD=0``).
Needs the GPU test environment (``scripts/gpu_env/install.sh``).

    python benchmark/bench_kit_layer.py [--requests 8 --history 8192 --extend 1024 --layers 4 --fp8] --out r.json

``--cp N`` runs N ranks, one process per GPU (upstream's distributed init over NCCL, the patched model-parallel
groups, the mode's exchange group): each layer's clock then also covers upstream's all-gather of the current KV on
the attention-CP group, beside the mode's history exchange on its own communicator; a layer's time is its slowest
rank's. ``--history`` takes a comma-separated sweep (issue 17: ``--cp 2 --history 8192,16384,32768 --extend 4096``).
``--heads``/``--topk`` set the layer's shape (default the kit's sparse cases: 4 heads, top-k 128;
``triton_sparse_mla`` takes up to 32 heads per rank; DeepSeek-V3.2's top-k is 2048). ``--profile`` also lists, per configuration, the GPU time of each kernel of one forward
(torch profiler) and the host time of the forward's layer loop, so the mode's added time is attributed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, distinct_page_tables, kit_capacity

CONFIGS = (("mode off", False, "1"), ("mode on, layer-ahead", True, "1"), ("mode on, synchronous", True, "0"))


def _case(args, history: int, cp: int) -> BatchCase:
    """``--requests`` requests of ``history`` + ``--extend`` tokens on distinct pages, or (``--shared-history``) all
    on the first request's history pages (one shared prompt, a radix hit: history page-aligned) and pages of
    their own for the current tokens."""
    longest = history + args.extend
    capacity = kit_capacity(args.requests, longest, cp)
    tables = distinct_page_tables([longest] * args.requests, capacity, seed=0, cp_size=cp)
    if args.shared_history:
        if history % PAGE:
            raise SystemExit(f"--shared-history needs a page-aligned --history (multiple of {PAGE}), got {history}")
        prompt = tables[0][: history // PAGE]
        tables = tuple(prompt + table[history // PAGE :] for table in tables)
    return BatchCase(PAGE, capacity, tables, (history,) * args.requests, (args.extend,) * args.requests, cp)


def measure(args, cp: int = 1, rank: int = 0, model_dir: str = "") -> list[dict]:
    """Every configuration at every history length on this rank: a fresh kit world each, timed."""
    from sglang_cpkv.testing.dsa_kit import publish_prefill_cp_server_args

    route = KitRoute("triton_sparse_mla", fp8=args.fp8, skip_topk_layers=(False,) * args.layers)
    rows = []
    for history in args.history:
        case = _case(args, history, cp)
        for label, mode_on, layer_ahead in CONFIGS:
            os.environ["SGLANG_CPKV_LAYER_AHEAD"] = layer_ahead
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
            plan_ms, layer_ms = world.time_layers(case, args.reps)
            rows.append({"history": history, "config": label, "plan_ms": plan_ms, "layer_ms": layer_ms})
            if args.profile:
                rows[-1]["kernels"] = _profile(world, case)
            del world
            torch.cuda.empty_cache()
    return rows


def _rank(rank: int, args, model_dir: str) -> None:
    """One CP rank on GPU ``rank``: upstream's distributed init (NCCL), the patched groups, then every config."""
    from sglang_cpkv.testing.dsa_kit import init_cp_rank

    init_cp_rank(rank, args.cp, "cuda", Path(model_dir, "dist_init").as_uri(), model_dir)
    Path(model_dir, f"rank{rank}.json").write_text(json.dumps(measure(args, args.cp, rank, model_dir)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument(
        "--history", type=lambda t: [int(x) for x in t.split(",")], default=[8192], help="comma-separated sweep"
    )
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--fp8", action="store_true", help="the 656-byte FP8 pool (RAGGED route)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--cp", type=int, default=1, help="CP ranks, one process per GPU over NCCL")
    parser.add_argument(
        "--shared-history", action="store_true", help="every request on one shared prompt of --history tokens"
    )
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time of one forward, per config")
    parser.add_argument("--out", help="write the figures here (json)")
    args = parser.parse_args(argv)
    if args.cp > torch.cuda.device_count():
        parser.error(f"--cp {args.cp} needs {args.cp} GPUs, {torch.cuda.device_count()} visible")
    if args.cp == 1:
        rows = measure(args)
    else:
        import tempfile

        import torch.multiprocessing as mp

        from sglang_cpkv.testing.dsa_kit import write_dsa_model_dir

        with tempfile.TemporaryDirectory() as tmp:
            write_dsa_model_dir(tmp)
            mp.spawn(_rank, args=(args, tmp), nprocs=args.cp, join=True)
            per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.cp)]
        # The critical path of a layer is its slowest rank's.
        rows = [
            dict(
                row,
                layer_ms=max(r[i]["layer_ms"] for r in per_rank),
                rank_layer_ms=[r[i]["layer_ms"] for r in per_rank],
            )
            for i, row in enumerate(per_rank[0])
        ]
    print(
        f"kit layer, triton_sparse_mla, {'FP8 656-byte' if args.fp8 else 'bf16'} pool, cp {args.cp}: {args.requests} "
        f"requests x {'one shared' if args.shared_history else 'distinct'} history + {args.extend} extend, "
        f"{args.layers} layers, {args.heads} heads, top-k {args.topk}, "
        f"median of {args.reps}" + (", the slowest rank's" if args.cp > 1 else "")
    )
    for row in rows:
        base = next(r["layer_ms"] for r in rows if r["history"] == row["history"] and r["config"] == "mode off")
        row["vs_off"] = row["layer_ms"] / base
        print(
            f"  history {row['history']:6d}  {row['config']:24s} plan {row['plan_ms']:8.3f} ms   "
            f"per layer {row['layer_ms']:8.3f} ms   x{row['vs_off']:.3f}"
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
