"""The page-id space of ``--enable-cp-shared-kv``: ``cp`` times the pages of one rank's pool.

Called from ``patches/core/widen-page-ids-under-cp-shared-kv.patch``: under the mode the KV-cache configurator
builds upstream's ``PageInterleavePoolAllocator`` (:func:`widens_page_ids`, :func:`page_interleave_allocator`; no
kv-shard scratch spec: the mode's buffers are its own reservation), whose page id ``l`` is rank ``l % cp``'s pool
page ``l // cp`` (:mod:`~sglang_cpkv.runtime.ownership`) and whose ids ``[0, cp)`` are reserved.
:func:`page_id_capacity` is ``C`` for the batch plan (:mod:`.dsa_metadata`); it refuses a CP pool whose allocator
this hook did not build. Design: ``docs/design/cp-shared-kv.md`` section 2, "Page ids"; the contract's "capacity".
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_cpkv.hooks import state
from sglang_cpkv.hooks.settings import FLAG, enabled
from sglang_cpkv.ops.errors import CpSharedKvError


def _cp_size() -> int:
    """The CP size of the mode's configuration (published where the pool was sized, before any allocator)."""
    return state.config().reservation.cp_size


def widens_page_ids() -> bool:
    """Whether this process's token allocator numbers ``cp`` x its pool pages: the mode on under CP."""
    return enabled() and _cp_size() > 1


def page_interleave_allocator(
    pool_tokens: int, page_size: int, dtype: torch.dtype, device: Any, kvcache: Any, need_sort: bool
) -> Any:
    """Upstream's ``PageInterleavePoolAllocator`` over ``cp`` x ``pool_tokens`` token locations of ``kvcache``
    (a pool of ``pool_tokens`` rows, plus its reserved page, on each rank)."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    cp_size = _cp_size()
    allocator = PageInterleavePoolAllocator(
        pool_tokens,
        physical_page_size=page_size,
        shard_size=cp_size,
        dtype=dtype,
        device=device,
        kvcache=kvcache,
        need_sort=need_sort,
        shard_spec=None,
    )
    state.current().allocator_cp = cp_size  # the CP size of the allocator the mode built in this process
    return allocator


def page_id_capacity(pool: Any) -> int:
    """``C`` for a batch on ``pool`` (the target's or the draft's pool: the draft shares the target's allocator):
    ``cp`` x its pages under the mode, its pages at cp 1.

    Raises:
        CpSharedKvError: under CP, no page-interleave allocator was built for this CP size in this process.
    """
    pages = (pool.size + pool.page_size) // pool.page_size
    cp_size = _cp_size()
    if cp_size == 1:
        return pages
    built_for = state.current().allocator_cp
    if built_for != cp_size:
        built = "none was built" if built_for is None else f"one was built for cp {built_for}"
        raise CpSharedKvError(
            f"{FLAG} at cp {cp_size} needs the token allocator that numbers cp x the pool's pages "
            f"(patches/core/widen-page-ids-under-cp-shared-kv.patch), and {built}"
        )
    return cp_size * pages
