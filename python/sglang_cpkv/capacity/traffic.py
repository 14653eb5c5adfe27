"""Bytes the mode moves per layer for one batch, counted from the real plan, and their time at a GPU's peaks.

A batch is each request's history and current token counts, on distinct pages or, with ``shared_history``, all on
one shared prompt (a radix hit); its plan is :func:`~sglang_cpkv.runtime.build_plan`'s, on the CPU. Per layer and
kind of paged KV, on the rank that packs the most pages: what ``runtime/pipeline.py`` moves (the history copy at
cp 1; the pack, the in-place all-gather and own pages' history rows under CP; the current rows into the dense view)
beside the floor any owner-sharded exchange must move. Times are lower bounds (bytes over the vendor's peaks, the
serial chain's steps summed). Used by :mod:`.planner`; what is counted and why: ``docs/operations.md``, "The
capacity planner" ("How it counts").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_cpkv.runtime import build_cp_split, build_plan


def batch_plan(
    prefix: Sequence[int],
    extend: Sequence[int],
    *,
    page_size: int,
    cp_size: int,
    cp_rank: int,
    shared_history: bool = False,
):
    """The plan of a batch whose requests hold distinct consecutive page ids after the ``cp_size`` ids upstream's
    page-interleave allocator reserves (page 0 of each rank's pool; at cp 1 page 0), on ``cp_size`` x pool pages.
    ``shared_history``: every request's history is the first ``prefix[0]`` tokens of one shared prompt (equal
    prefixes, page-aligned, as a radix hit gives them), its current pages its own."""
    if shared_history and (len(set(prefix)) != 1 or prefix[0] % page_size):
        raise ValueError(f"a shared history needs one page-aligned prefix for every request, got {list(prefix)}")
    history_pages = prefix[0] // page_size if shared_history else 0
    own = [-(-(p + e) // page_size) - history_pages for p, e in zip(prefix, extend)]
    starts = [cp_size + history_pages + sum(own[:r]) for r in range(len(own))]
    shared = list(range(cp_size, cp_size + history_pages))
    table = [shared + list(range(starts[r], starts[r] + own[r])) for r in range(len(own))]
    out_cache_loc = torch.cat(
        [
            torch.tensor(
                [table[r][p // page_size] * page_size + p % page_size for p in range(prefix[r], prefix[r] + extend[r])]
            )
            for r in range(len(own))
        ]
    )
    split = cp_size > 1 and sum(extend) >= cp_size
    return build_plan(
        table,
        list(prefix),
        list(extend),
        out_cache_loc,
        capacity=cp_size * -(-(starts[-1] + own[-1]) // cp_size),
        page_size=page_size,
        split=build_cp_split("interleave" if split else "none", extend, cp_size, cp_rank),
        checked=False,
    )


@dataclass(frozen=True)
class LayerTraffic:
    """One layer's bytes on one rank (both kinds), today's pipeline and the floor, and their lower-bound times.

    Attributes:
        history_pages: the distinct history pages of the batch (the plan's history region).
        packed_pages: distinct history pages this rank packs (its owned ones; at cp 1 every history copy).
        own_history_pages: own pages that take history rows (copied from the region under CP).
        dense_rows: the plan's dense rows (``num_slots * page_size``); entry_rows: what one view per request
            would need (``sum n_r`` pages).
        link_bytes, hbm_bytes: today's pipeline; hbm_parts: its HBM bytes by step (``history copy`` at cp 1;
            ``pack``, ``all-gather``, ``own history rows`` under CP; ``current rows``). floor_link_bytes,
            floor_hbm_bytes: the floor (module docstring).
    """

    cp_size: int
    history_pages: int
    packed_pages: int
    own_history_pages: int
    dense_rows: int
    entry_rows: int
    entries: int  # the batch's page-table entries (the reservation's check counts them)
    needed_rows: int  # the rows the batch's pages fill (the reservation's check counts them)
    num_slots: int
    num_tokens: int
    link_bytes: int
    hbm_bytes: int
    hbm_parts: dict[str, int]
    floor_link_bytes: int
    floor_hbm_bytes: int

    def times(self, hbm_bandwidth: float, link_bandwidth: float) -> dict[str, float]:
        """Lower bounds in seconds: today's exchange (link), today's HBM copies, their sum; the floor's."""
        link, hbm = self.link_bytes / link_bandwidth, self.hbm_bytes / hbm_bandwidth
        floor = self.floor_link_bytes / link_bandwidth + self.floor_hbm_bytes / hbm_bandwidth
        return {"exchange_s": link, "copies_s": hbm, "total_s": link + hbm, "floor_s": floor}


def layer_traffic(
    prefix: Sequence[int],
    extend: Sequence[int],
    *,
    page_size: int,
    cp_size: int,
    latent_token_bytes: int,
    index_k_token_bytes: int,
    shared_history: bool = False,
) -> LayerTraffic:
    """Per-layer bytes of the batch (module docstring), on the rank that packs the most pages."""
    plans = [
        batch_plan(prefix, extend, page_size=page_size, cp_size=cp_size, cp_rank=rank, shared_history=shared_history)
        for rank in range(cp_size)
    ]
    packed = [int(plan.pool_copy_pages.numel()) for plan in plans]
    rank = max(range(cp_size), key=packed.__getitem__)
    plan = plans[rank]
    page_bytes = page_size * (latent_token_bytes + index_k_token_bytes)
    region = plan.history_region_slots
    own_history = int(plan.view_copy_dst_slots.numel())
    current = 2 * plan.num_tokens * latent_token_bytes
    if cp_size == 1:
        link, parts = 0, {"history copy": 2 * packed[rank] * page_bytes}
        own_history = packed[rank] - region
        floor_link, floor_hbm = 0, 2 * region * page_bytes + current
    else:
        received = region - packed[rank]
        link = received * page_bytes
        parts = {
            "pack": 2 * packed[rank] * page_bytes,
            "all-gather": (received + packed[rank]) * page_bytes,  # the others' pages written, this rank's read
            "own history rows": 2 * own_history * page_bytes,
        }
        floor_link = link
        floor_hbm = parts["pack"] + parts["all-gather"] + current
    parts["current rows"] = current
    return LayerTraffic(
        cp_size=cp_size,
        history_pages=region,
        packed_pages=packed[rank],
        own_history_pages=own_history,
        dense_rows=plan.dense_rows,
        entry_rows=plan.entries * page_size,
        entries=plan.entries,
        needed_rows=plan.needed_slots * page_size,
        num_slots=plan.num_slots,
        num_tokens=plan.num_tokens,
        link_bytes=link,
        hbm_bytes=sum(parts.values()),
        hbm_parts=parts,
        floor_link_bytes=floor_link,
        floor_hbm_bytes=floor_hbm,
    )
