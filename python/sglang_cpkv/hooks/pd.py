"""P/D transfer under ``--enable-cp-shared-kv``: each prefill CP rank sends the pages it owns.

Called from ``patches/core/send-owned-pages-under-cp-shared-kv.patch`` (design section 8). A page
id is owned by CP rank ``page_id % cp_size`` and stays at the same page id in that rank's pool
(no compression, unlike upstream's kv-sharding, whose ``filter_kv_indices_for_shard_rank`` sends
``page_id // N``), so a rank sends its owned page ids unchanged together with their positions in
the request's page list; the decode side writes each at the destination page of that position.
Every page has exactly one owner, so the ranks' sends partition the request. The DSA indexer
state pages (index K) are owner-sharded the same way and filtered with the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def filter_owned_kv_indices(
    kv_indices: np.ndarray, index_slice: slice, cp_rank: int, cp_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The owned page ids of one send chunk and their positions in the request's page list.

    Args:
        kv_indices: page ids of the chunk (positions ``index_slice`` of the request's page list).
        index_slice: the chunk's positions (``start``/``stop`` set, as the sender builds it).

    Returns:
        ``(owned page ids, positions)``; ``positions`` replaces the contiguous slice.
    """
    kv_indices = np.asarray(kv_indices)
    positions = np.arange(index_slice.start, index_slice.stop, dtype=np.int64)
    if positions.shape[0] != kv_indices.shape[0]:
        raise ValueError(
            f"send chunk has {kv_indices.shape[0]} page ids for positions {index_slice.start}..{index_slice.stop}"
        )
    owned = kv_indices % cp_size == cp_rank
    return kv_indices[owned], positions[owned]


def filter_owned_state_pages(
    src_pages: Sequence[int], dst_pages: Sequence[int], cp_rank: int, cp_size: int
) -> tuple[list[int], list[int]]:
    """Owned DSA state (index-K) pages and their paired destination pages."""
    if len(src_pages) != len(dst_pages):
        raise RuntimeError(
            f"DSA state page count mismatch under CP shared-KV: prefill={len(src_pages)}, decode={len(dst_pages)}"
        )
    src = np.asarray(src_pages, dtype=np.int64)
    owned = src % cp_size == cp_rank
    return src[owned].tolist(), np.asarray(dst_pages, dtype=np.int64)[owned].tolist()
