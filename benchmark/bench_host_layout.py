"""The plan's host layout and staging, compiled vs its numpy reference, on the host alone.

What the compiled layout (``sglang_cpkv.runtime.host_layout``) replaces in the mode's per-batch plan: the batch's dense
layout from its host page ids and the staging buffer the device work reads (``plan._host_layout`` then
``plan._stage``, the staging's copy to the device excluded). For each request count, sharing and CP rank count the
two layouts take turns call by call on one batch of ``--history`` + ``--extend`` tokens per request (pages drawn
across the pool the kit would size, as ``bench_plan_host.py`` does); reported: the median of each and the median
over rounds of the saving. Host only: no GPU, no upstream.

    python benchmark/bench_host_layout.py [--requests 1,8,64 --history 8192 --extend 1024 --cp 1,8] --out layout.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from sglang_cpkv.runtime import host_layout, plan
from sglang_cpkv.runtime.buckets import round_dense_slots
from sglang_cpkv.testing.dsa_kit import PAGE, distinct_page_tables, kit_capacity

SHARINGS = ("distinct", "shared")


def _tables(requests: int, history: int, extend: int, sharing: str, cp: int) -> tuple[torch.Tensor, int]:
    """int32 ``[R, W]`` page ids and the capacity: distinct pages per request, or one shared history prompt (each
    request's current pages its own)."""
    longest = history + extend
    capacity = kit_capacity(requests, longest, cp)
    tables = distinct_page_tables([longest] * requests, capacity, seed=0, cp_size=cp)
    if sharing == "shared":
        prompt = tables[0][: history // PAGE]
        tables = tuple(prompt + t[history // PAGE :] for t in tables)
    return torch.tensor(tables, dtype=torch.int32), capacity


def _layout_and_stage(make, table, prefix, extend, pages_needed, kwargs) -> float:
    start = time.perf_counter()
    layout = make(table, table.shape[1], prefix, extend, pages_needed, **kwargs)
    plan._stage(torch.device("cpu"), layout, round_dense_slots(layout.region_slots + layout.own_slots))
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 64])
    parser.add_argument("--history", type=int, default=8192)
    parser.add_argument("--extend", type=int, default=1024)
    parser.add_argument("--cp", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--out", help="write the figures here (json)")
    args = parser.parse_args(argv)
    lib = host_layout.library()
    if lib is None:
        parser.error("the compiled host layout is not built: python -m sglang_cpkv.runtime.host_layout_build")

    def compiled(table, width, prefix, extend, pages_needed, **kwargs):
        return host_layout.CompiledLayout(lib, table, width, prefix, extend, pages_needed, **kwargs)

    makers = (("numpy", plan._NumpyLayout), ("compiled", compiled))
    rows = []
    for cp in args.cp:
        for sharing in SHARINGS:
            for requests in args.requests:
                table, capacity = _tables(requests, args.history, args.extend, sharing, cp)
                prefix, extend = (args.history,) * requests, (args.extend,) * requests
                pages_needed = plan._pages_needed(table.shape[1], prefix, extend, PAGE)
                kwargs = dict(page_size=PAGE, cp_size=cp, cp_rank=0, capacity=capacity, validate=False)
                times: dict[str, list[float]] = {name: [] for name, _ in makers}
                for round_ in range(args.reps + 20):  # 20 warm-up rounds; the order turns each round
                    for name, make in makers[round_ % 2 :] + makers[: round_ % 2]:
                        times[name].append(_layout_and_stage(make, table, prefix, extend, pages_needed, kwargs))
                numpy_us, compiled_us = ([t * 1e6 for t in times[name][20:]] for name, _ in makers)
                rows.append(
                    {
                        "cp": cp,
                        "sharing": sharing,
                        "requests": requests,
                        "entries": sum(pages_needed),
                        "numpy_us": statistics.median(numpy_us),
                        "compiled_us": statistics.median(compiled_us),
                        "saving_us": statistics.median(n - c for n, c in zip(numpy_us, compiled_us)),
                    }
                )
    host = platform.processor() or platform.machine()
    print(
        f"the plan's host layout and staging (no copy to a device), {args.history} + {args.extend} tokens per request, "
        f"page {PAGE}, median of {args.reps} alternating calls, {host}"
    )
    for row in rows:
        print(
            f"  cp {row['cp']}  {row['sharing']:8s} {row['requests']:3d} requests ({row['entries']:5d} entries)  "
            f"numpy {row['numpy_us']:7.1f} us  compiled {row['compiled_us']:7.1f} us  saving {row['saving_us']:7.1f} us"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "host": host, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
