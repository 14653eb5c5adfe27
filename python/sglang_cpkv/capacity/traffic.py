"""Bytes the mode moves per layer for one batch, counted from the real plan, and their time at a GPU's peaks.

A batch is each request's history and current token counts; every request holds distinct pages. Its plan is
:func:`~sglang_cpkv.runtime.build_plan`'s (host tensors, on the CPU), with the exchange rounds bounded by the
reservation's exchange buffers as in serving. Per layer and kind of paged KV (latent rows; DSA index-K pages),
on one rank (the one packing the most pages), what ``runtime/pipeline.py`` moves:

* cp 1: the history copy, pool -> dense view (``ops.copy_pages``: every history page read and written);
* cp > 1, per exchange round of ``K`` pages per rank: the pack (this rank's owned history pages of the round
  into the send buffer, read and written), the all-gather (``(cp - 1) * K`` pages received over the link; the
  ``cp * K`` gathered pages written and the send buffer read in HBM), the unpack (every history slot's page from
  the gathered buffer into the dense view, read and written);
* the current rows into the dense view (the latent kind's ``scatter_rows``; upstream's own kernel writes the
  index-K keys there instead of into the pool, so that kind adds nothing). The owned rows persisted replace
  upstream's own cache write and are not counted.

The floor is what any owner-sharded exchange must move: the all-gather of a perfectly balanced, unpadded
share of the batch's distinct history pages (``ceil(D / cp)`` per rank, one round) straight into the dense view,
plus packing this rank's owned pages; at cp 1 nothing (the attention could read the pool itself).

Times are lower bounds: bytes over the vendor's peak (HBM; NVLink per direction), the serial chain's steps
summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_cpkv.runtime import build_plan


def batch_plan(
    prefix: Sequence[int],
    extend: Sequence[int],
    *,
    page_size: int,
    cp_size: int,
    cp_rank: int,
    exchange_pages_per_round: int | None = None,
):
    """The plan of a batch whose requests hold distinct consecutive page ids after the ``cp_size`` ids upstream's
    page-interleave allocator reserves (page 0 of each rank's pool; at cp 1 page 0), on ``cp_size`` x pool pages."""
    pages = [-(-(p + e) // page_size) for p, e in zip(prefix, extend)]
    starts = [cp_size + sum(pages[:r]) for r in range(len(pages))]
    table = [list(range(starts[r], starts[r] + pages[r])) for r in range(len(pages))]
    out_cache_loc = torch.cat(
        [
            torch.arange(starts[r] * page_size + prefix[r], starts[r] * page_size + prefix[r] + extend[r])
            for r in range(len(pages))
        ]
    )
    split = cp_size > 1 and sum(extend) >= cp_size
    return build_plan(
        table,
        list(prefix),
        list(extend),
        out_cache_loc,
        capacity=cp_size * -(-(sum(pages) + cp_size) // cp_size),
        page_size=page_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        strategy="interleave" if split else "none",
        exchange_pages_per_round=exchange_pages_per_round,
        checked=False,
    )


@dataclass(frozen=True)
class LayerTraffic:
    """One layer's bytes on one rank (both kinds), today's pipeline and the floor, and their lower-bound times.

    Attributes:
        history_pages: the dense view's history slots (every request's history pages).
        packed_pages: distinct history pages this rank packs (its owned ones; 0 at cp 1).
        rounds, pages_per_round: the exchange's rounds and ``K``.
        dense_rows: the plan's dense rows (``num_slots * page_size``).
        link_bytes, hbm_bytes: today's pipeline; hbm_parts: its HBM bytes by step (``history copy`` at cp 1;
            ``pack``, ``all-gather``, ``unpack`` under CP; ``current rows``). floor_link_bytes, floor_hbm_bytes: the
            floor.
    """

    cp_size: int
    history_pages: int
    packed_pages: int
    rounds: int
    pages_per_round: int
    dense_rows: int
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
    exchange_pages_per_round: int | None = None,
) -> LayerTraffic:
    """Per-layer bytes of the batch (module docstring), on the rank that packs the most pages."""
    plans = [
        batch_plan(
            prefix,
            extend,
            page_size=page_size,
            cp_size=cp_size,
            cp_rank=rank,
            exchange_pages_per_round=exchange_pages_per_round,
        )
        for rank in range(cp_size)
    ]
    packed = [sum(int((r.send_pages >= 0).sum()) for r in plan.exchange_rounds) for plan in plans]
    rank = max(range(cp_size), key=packed.__getitem__)
    plan = plans[rank]
    page_bytes = page_size * (latent_token_bytes + index_k_token_bytes)
    history = int(plan.history_slots.numel())
    rounds, k = len(plan.exchange_rounds), plan.exchange_pages_per_round
    if cp_size == 1:
        link, parts = 0, {"history copy": 2 * history * page_bytes}
        floor_link = floor_hbm = 0
    else:
        link = rounds * (cp_size - 1) * k * page_bytes
        parts = {
            "pack": 2 * packed[rank] * page_bytes,
            "all-gather": rounds * (cp_size + 1) * k * page_bytes,  # the gathered pages written, the send read
            "unpack": 2 * history * page_bytes,
        }
        share = -(-history // cp_size)  # distinct pages: every request holds its own
        floor_link = (cp_size - 1) * share * page_bytes
        floor_hbm = 2 * share * page_bytes + (cp_size + 1) * share * page_bytes
    parts["current rows"] = 2 * plan.num_tokens * latent_token_bytes
    return LayerTraffic(
        cp_size=cp_size,
        history_pages=history,
        packed_pages=packed[rank],
        rounds=rounds,
        pages_per_round=k,
        dense_rows=plan.dense_rows,
        link_bytes=link,
        hbm_bytes=sum(parts.values()),
        hbm_parts=parts,
        floor_link_bytes=floor_link,
        floor_hbm_bytes=floor_hbm,
    )
