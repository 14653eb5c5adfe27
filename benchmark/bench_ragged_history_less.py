"""The per-layer cost of the RAGGED route's per-request keys (``read-history-less-requests-alike-on-ragged.patch``).

Through :class:`sglang_cpkv.testing.dsa_kit.KitWorld` (upstream's kit runner, pools and backend, the patched
``forward_extend``, the route's real kernel), the mode off, an FP8 656-byte pool on the RAGGED route
(``flashmla_sparse`` or ``triton_sparse_mla``): a batch of ``--requests`` requests of ``--extend`` current tokens,
the first ``--with-history`` of them over ``--history`` cached tokens each, the others without history (the batch the
fix changes). Each layer is timed **before** the fix (its write of the history-less requests' bf16 rows replaced by
"leave the dequantized rows", upstream's behaviour) and **after**, alternating ``--rounds`` times in one process on
the same world, CUDA events around the layer loop (``kit_timing.time_layers``), medians of ``--reps`` forwards; the
figure is the layer's time after minus before, with its spread over the rounds.

    python benchmark/bench_ragged_history_less.py --backend flashmla_sparse --heads 64 --topk 2048 \\
        --requests 8 --with-history 4 --history 8192,32768 --extend 1024 --out ragged.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from sglang_cpkv.hooks.upstream_fixes import ragged_current_rows
from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, distinct_page_tables, kit_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kit_timing, a sibling module
from kit_timing import time_layers


@contextmanager
def _before_the_fix():
    """Upstream's keys: the dequantized rows of every kept request, history-less ones included."""
    write = ragged_current_rows.write_history_less_rows
    ragged_current_rows.write_history_less_rows = lambda kv, k, k_rope, rows: kv
    try:
        yield
    finally:
        ragged_current_rows.write_history_less_rows = write


def _case(args, history: int) -> BatchCase:
    lengths = [history + args.extend] * args.with_history + [args.extend] * (args.requests - args.with_history)
    capacity = kit_capacity(args.requests, max(lengths))
    tables = distinct_page_tables(lengths, capacity, seed=0)
    prefix = (history,) * args.with_history + (0,) * (args.requests - args.with_history)
    return BatchCase(PAGE, capacity, tables, prefix, (args.extend,) * args.requests)


def measure(args) -> list[dict]:
    route = KitRoute(args.backend, fp8=True, skip_topk_layers=(False,) * args.layers)
    rows = []
    for history in args.history:
        case = _case(args, history)
        world = KitWorld(
            route,
            max_requests=args.requests,
            longest=history + args.extend,
            mode_on=False,
            device=torch.cuda.current_device(),
            heads=args.heads,
            topk=args.topk,
        )
        world.write_history(case)
        layer = {"before": [], "after": []}
        for _ in range(args.rounds):
            with _before_the_fix():
                layer["before"].append(time_layers(world, case, args.reps)[1])
            layer["after"].append(time_layers(world, case, args.reps)[1])
        deltas = [a - b for a, b in zip(layer["after"], layer["before"])]
        rows.append(
            {
                "history": history,
                "kernel": world.backend.dsa_prefill_impl,
                "history_less_rows": args.extend * (args.requests - args.with_history),
                "layer_ms_before": statistics.median(layer["before"]),
                "layer_ms_after": statistics.median(layer["after"]),
                "layer_ms_rounds": layer,
                "added_us": 1e3 * statistics.median(deltas),
                "added_us_spread": [1e3 * min(deltas), 1e3 * max(deltas)],
            }
        )
        del world
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("flashmla_sparse", "triton_sparse_mla"), default="flashmla_sparse")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--with-history", type=int, default=4)
    parser.add_argument("--history", type=lambda t: [int(x) for x in t.split(",")], default=[8192])
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4, help="kit layers timed")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the figures here (json)")
    args = parser.parse_args(argv)
    if not 0 < args.with_history < args.requests:
        parser.error("--with-history must leave some requests with and some without history")
    if not torch.cuda.is_available():
        parser.error("needs a GPU (the route's real kernel)")
    rows = measure(args)
    print(
        f"RAGGED, {args.backend}, FP8 656-byte pool, mode off: {args.requests} requests x {args.extend} extend, "
        f"{args.with_history} over a cached history; {args.heads} heads, top-k {args.topk}; median of {args.reps} "
        f"forwards, {args.rounds} rounds before/after alternating"
    )
    for row in rows:
        lo, hi = row["added_us_spread"]
        print(
            f"  history {row['history']:6d} ({row['kernel']}): layer {row['layer_ms_before']:.3f} ms before, "
            f"{row['layer_ms_after']:.3f} ms after: {row['added_us']:+.1f} us [{lo:+.1f} .. {hi:+.1f}] per layer "
            f"for {row['history_less_rows']} history-less rows"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
