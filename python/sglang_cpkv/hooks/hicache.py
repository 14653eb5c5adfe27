"""HiCache host offload beside ``--enable-cp-shared-kv``: each rank backs up and loads back the pages it owns.

Called from ``patches/core/shard-hicache-host-pool-under-cp-shared-kv.patch`` (:func:`owner_sharded_host_pool`, at
the end of upstream's ``build_kv_host_pool``: the host pool gets upstream's ``PageInterleaveHostPool`` wrapper with
the mode's ownership rule, so upstream's sharded HiCache path moves each rank's owned rows), from
:mod:`.server_args` (:func:`validate_hicache_args`) and from :mod:`.dsa_batch` (:func:`after_layer_load`, around
every pool read of the mode: the wait for a layer's load). Design: ``docs/design/cp-shared-kv-hicache.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang_cpkv.hooks import state
from sglang_cpkv.hooks.page_ids import widens_page_ids
from sglang_cpkv.hooks.settings import FLAG

# What upstream's sharded DSA HiCache supports (``arg_groups/kv_shard_hook.py``), the forms the mode is proven with;
# its third condition, host memory mode ``cache``, holds once the storage backend is refused (``buffer_only`` needs one).
IO_BACKEND = "kernel"
MEM_LAYOUTS = ("layer_first", "page_first")


def validate_hicache_args(cfg: Any) -> None:
    """Refuse, naming the flag, a HiCache configuration beside the mode that is not the one proven: a storage backend
    (every CP rank would write its stripe of a page under the page's one key), and what upstream's own sharded DSA
    HiCache refuses."""
    if not cfg.enable_hierarchical_cache:
        return
    if cfg.hicache_storage_backend is not None:
        raise ValueError(
            f"{FLAG}: cannot be combined with --hicache-storage-backend ({cfg.hicache_storage_backend!r}): a storage "
            "key names a page, while each CP rank holds only the rows of the pages it owns, so every rank would write "
            "and read its own stripe under the same key"
        )
    if cfg.hicache_mem_layout not in MEM_LAYOUTS:
        raise ValueError(
            f"{FLAG}: with --enable-hierarchical-cache requires --hicache-mem-layout in {MEM_LAYOUTS} (as upstream's "
            f"CP-sharded DSA HiCache), got {cfg.hicache_mem_layout!r}"
        )
    if cfg.hicache_io_backend != IO_BACKEND:
        raise ValueError(
            f"{FLAG}: with --enable-hierarchical-cache requires --hicache-io-backend {IO_BACKEND} (as upstream's "
            f"CP-sharded DSA HiCache), got {cfg.hicache_io_backend!r}"
        )


def owner_sharded_host_pool(host_pool: Any, kv_pool: Any) -> Any:
    """``host_pool`` of ``kv_pool``, wrapped in upstream's ``PageInterleaveHostPool`` when this process's allocator
    numbers ``cp`` x the pool's pages (the mode under CP): backups take host slots of the page's owner class and every
    transfer moves this rank's owned rows only. Otherwise ``host_pool`` as upstream built it."""
    if not widens_page_ids():
        return host_pool
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    from sglang_cpkv.hooks.exchange_group import exchange_group

    spec = PageShardSpec(
        shard_rank=exchange_group().cp_rank,
        shard_size=state.config().reservation.cp_size,
        page_size=kv_pool.page_size,
        max_prefix_tokens=0,  # kv-sharding's gather scratch: the mode has none
        chunk_tokens=0,
    )
    return PageInterleaveHostPool(host_pool, PageInterleavePlacement(spec))


def after_layer_load(pool: Any, pages_of: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """``pages_of`` behind HiCache's per-layer load: before a layer's pool pages are read, the current stream (the
    one that copies them: the side stream of a layer-ahead prefetch) waits for the load of that layer into the pool,
    through the counter upstream's own readers wait on (``get_key_buffer``); no counter, no wait."""

    def pages(layer: int) -> torch.Tensor:
        counter = pool.layer_transfer_counter
        if counter is not None:
            counter.wait_until(layer - pool.start_layer)
        return pages_of(layer)

    return pages
