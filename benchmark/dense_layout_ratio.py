"""Dense view size vs the rows a batch needs, with the real ``build_plan`` (page size 64, cp 8).

For each batch of a sweep of mixed shapes (the issue's four, then random mixes of long and short histories; pages
per request from :func:`sglang_cpkv.capacity.traffic.batch_plan`: distinct, or one shared prompt for the
shared-prompt batch), the plan's dense rows (``num_slots * page_size``) are divided by the rows the batch needs
(the distinct pages it reads as history, plus its current pages, x ``page_size``), and the bytes of the mode's four
per-layer dense buffers (latent and index K, double-buffered) are reported for GLM-5.1-FP8 rows (656-byte latent,
132-byte index-K rows). Two earlier layouts are computed alongside from the same lengths: the per-request ragged
layout (every request's pages in its own slots, ``sum n_r`` pages: issue 24 replaced it with shared history slots)
and the ``R x P`` one before it (``P`` the longest request's pages rounded to a power of two).

    python benchmark/dense_layout_ratio.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random

from sglang_cpkv.capacity.traffic import batch_plan

PAGE = 64
CP, RANK = 8, 3
LATENT_ROW, INDEX_K_ROW = 656, 132  # GLM-5.1-FP8: packed FP8 latent, index K (128 fp8 + 4-byte scale) per token


def old_layout_rows(prefix: list[int], extend: list[int]) -> int:
    """``R * P * page_size`` with ``P`` the largest page count rounded up to a power of two (as before)."""
    longest = max(-(-(p + e) // PAGE) for p, e in zip(prefix, extend))
    return len(prefix) * (1 << (longest - 1).bit_length()) * PAGE


def measure(name: str, prefix: list[int], extend: list[int], shared_history: bool = False) -> dict:
    plan = batch_plan(prefix, extend, page_size=PAGE, cp_size=CP, cp_rank=RANK, shared_history=shared_history)
    history = -(-prefix[0] // PAGE) if shared_history else sum(-(-p // PAGE) for p in prefix)
    current = sum(-(-(p + e) // PAGE) - p // PAGE for p, e in zip(prefix, extend))
    needed = (history + current) * PAGE
    per_request = plan.entries * PAGE
    buffers = 2 * (LATENT_ROW + INDEX_K_ROW)  # bytes per dense row of the four views
    return {
        "batch": name,
        "requests": len(prefix),
        "needed_rows": needed,
        "dense_rows": plan.dense_rows,
        "ratio": plan.dense_rows / needed,
        "per_request_rows": per_request,
        "per_request_ratio": per_request / needed,
        "old_ratio": old_layout_rows(prefix, extend) / needed,
        "buffer_gib": buffers * plan.dense_rows / 2**30,
        "per_request_buffer_gib": buffers * per_request / 2**30,
        "old_buffer_gib": buffers * old_layout_rows(prefix, extend) / 2**30,
    }


def sweep(seed: int, count: int):
    rng = random.Random(seed)
    for i in range(count):
        bs = rng.randint(1, 32)
        prefix = [rng.choice([0, rng.randint(1, 4096), rng.randint(4096, 160 * 1024)]) for _ in range(bs)]
        extend = [rng.randint(1, 8192) for _ in range(bs)]
        yield f"random-{seed}-{i}", prefix, extend


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--random", type=int, default=200, help="random mixed batches")
    args = parser.parse_args(argv)
    named = [
        ("8 x 64K distinct history + 2K", [64 * 1024] * 8, [2048] * 8),
        ("1 x 160K history + 31 new", [160 * 1024] + [0] * 31, [512] * 32),
        ("3 x 1K + 1 x 100K history, 512 each", [1024] * 3 + [100 * 1024], [512] * 4),
        ("16 x 60K shared prompt + 1K", [60 * 1024] * 16, [1024] * 16, True),
    ]
    rows = [measure(*b) for b in named] + [measure(*b) for b in sweep(1, args.random)]
    print(
        f"{'batch':40s} {'R':>3s} {'needed rows':>12s} {'dense/needed':>12s} {'per-request':>11s} {'old':>7s} "
        f"{'GiB':>7s} {'per-req GiB':>11s} {'old GiB':>8s}"
    )
    for row in rows[: len(named)]:
        print(
            f"{row['batch']:40s} {row['requests']:3d} {row['needed_rows']:12d} {row['ratio']:12.4f} "
            f"{row['per_request_ratio']:11.2f} {row['old_ratio']:7.2f} {row['buffer_gib']:7.3f} "
            f"{row['per_request_buffer_gib']:11.3f} {row['old_buffer_gib']:8.3f}"
        )
    randoms = rows[len(named) :]
    worst = max(randoms, key=lambda r: r["ratio"])
    print(
        f"{len(randoms)} random mixed batches (bs 1-32, histories 0-160K, extends 1-8K): worst dense/needed "
        f"{worst['ratio']:.4f} (old layout's worst {max(r['old_ratio'] for r in randoms):.2f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
