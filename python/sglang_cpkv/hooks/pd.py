"""P/D transfer under ``--enable-cp-shared-kv``: each prefill CP rank sends the pages it owns.

Called from ``patches/core/send-owned-pages-under-cp-shared-kv.patch``: a rank sends the owner pool pages
(``page_id // cp``) of its owned page ids (``page_id % cp``, the rule of upstream's kv-sharding
``filter_kv_indices_for_shard_rank``) with their positions in the request's page list, so the ranks' sends
partition the request; the DSA indexer state pages follow the same rule. From
``patches/core/publish-cp-shared-kv-mode-to-decode.patch``: the prefill publishes ``enable_cp_shared_kv`` in its
bootstrap info (absent with the mode off), and a decode that reads it pulls from every prefill CP rank
(:func:`decode_pulls_from_every_cp_rank`). Design: ``docs/design/cp-shared-kv.md`` section 8.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from sglang_cpkv.runtime.ownership import owner_pool_page, page_owner

logger = logging.getLogger(__name__)


def filter_owned_kv_indices(
    kv_indices: np.ndarray, index_slice: slice, cp_rank: int, cp_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The pool pages of the owned page ids of one send chunk, and their positions in the request's page list.

    Args:
        kv_indices: page ids of the chunk (positions ``index_slice`` of the request's page list).
        index_slice: the chunk's positions (``start``/``stop`` set, as the sender builds it).

    Returns:
        ``(this rank's pool pages of the owned page ids, positions)``; ``positions`` replaces the contiguous slice.
    """
    kv_indices = np.asarray(kv_indices)
    positions = np.arange(index_slice.start, index_slice.stop, dtype=np.int64)
    if positions.shape[0] != kv_indices.shape[0]:
        raise ValueError(
            f"send chunk has {kv_indices.shape[0]} page ids for positions {index_slice.start}..{index_slice.stop}"
        )
    owned = page_owner(kv_indices, cp_size) == cp_rank
    return owner_pool_page(kv_indices[owned], cp_size), positions[owned]


def filter_owned_state_pages(
    src_pages: Sequence[int], dst_pages: Sequence[int], cp_rank: int, cp_size: int
) -> tuple[list[int], list[int]]:
    """The pool pages of the owned DSA state (index-K) page ids and their paired destination pages.

    Source and destination pages pair by position. Upstream's Mooncake state send tolerates a
    length drift of the paged DSA state between the two sides (it warns and truncates the longer
    list to the shorter); the same truncation runs here, before the owner filter, so the pairs
    this rank sends are the pairs upstream would send, restricted to the pages it owns.
    """
    if len(src_pages) != len(dst_pages):
        logger.warning(
            "DSA state page count differs under CP shared-KV: prefill=%d, decode=%d; sending the first %d pairs",
            len(src_pages),
            len(dst_pages),
            min(len(src_pages), len(dst_pages)),
        )
    paired = min(len(src_pages), len(dst_pages))
    src = np.asarray(src_pages[:paired], dtype=np.int64)
    owned = page_owner(src, cp_size) == cp_rank
    return owner_pool_page(src[owned], cp_size).tolist(), np.asarray(dst_pages[:paired], dtype=np.int64)[owned].tolist()


def decode_pulls_from_every_cp_rank(prefill_info: Any) -> bool:
    """Decode side, at first contact: whether the prefill's bootstrap info publishes the mode.

    Args:
        prefill_info: upstream's ``PrefillServerInfo`` as fetched from the prefill's bootstrap server.

    Returns:
        True when the prefill runs ``--enable-cp-shared-kv``: every one of its CP ranks holds only
        the pages it owns, so the decode pulls from all of them.
    """
    if not prefill_info.enable_cp_shared_kv:
        return False
    logger.info(
        "prefill publishes --enable-cp-shared-kv: pulling KV from all %d of its CP ranks",
        prefill_info.attn_cp_size,
    )
    return True
