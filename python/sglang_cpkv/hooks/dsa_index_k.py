"""The DSA indexer's index K under the mode: the dense index-K pages (history, then the current keys stored by
upstream's own kernels) and this rank's owned rows persisted.

Called from ``patches/core/hook-cp-shared-kv-into-dsa-extend.patch`` (:func:`store_index_k`, the store where upstream's
fused one does not apply; :func:`index_k_and_scale`, the read) and ``patches/core/follow-the-dense-layout-in-dsa-checks.patch``
(:func:`index_k_write_targets`, the targets of upstream's fused stores); design: ``docs/design/cp-shared-kv.md``
section 4. Each returns upstream's own value (or does nothing) when the flag is off.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_cpkv.hooks.cache_write import check_cache_write_rows
from sglang_cpkv.hooks.dsa_batch import INDEX_K, ExtendBatch, indexer_batch
from sglang_cpkv.ops.errors import CpSharedKvError


def _index_k_targets(batch: ExtendBatch, pool: Any, layer_id: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``(buffer, locations)`` the layer's current keys go to: its dense index-K pages at the dense locations
    (after the layer's history was taken), then this rank's pool at the owned locations."""
    dense_pages = batch.pipeline.dense_pages(INDEX_K, layer_id)
    dense_locs = batch.pipeline.current_write_locs(INDEX_K, layer_id)
    batch.pipeline.owned_write_locs(INDEX_K, layer_id)  # the history was taken: persisting is safe now
    batch.index_k_stored_layer = layer_id
    return (dense_pages, dense_locs), (pool.get_index_k_with_scale_buffer(layer_id), batch.pool_write_locs)


def index_k_write_targets(pool: Any, forward_batch: Any, layer_id: int, loc: torch.Tensor, upstream_targets: Any):
    """The ``(buffer, locations, rows)`` targets of upstream's fused index-K stores (``fused_store_index_k_cache``
    and the fused-indexer ``fused_k_indexer_norm_rope_store``): upstream's own ``_index_k_write_targets`` when the
    mode is off, else the dense index-K pages and the owned pool rows (:func:`_index_k_targets`)."""
    batch = indexer_batch(forward_batch)
    if batch is None:
        return upstream_targets(pool, layer_id, loc)
    check_cache_write_rows(batch.plan, loc.shape[0], f"layer {layer_id} index-K store")
    return tuple((buffer, locs, None) for buffer, locs in _index_k_targets(batch, pool, layer_id))


def store_index_k(
    pool: Any, forward_batch: Any, layer_id: int, key: torch.Tensor, act_quant: Any, block_size: int, scale_fmt: Any
) -> bool:
    """The index-K store where upstream's fused store does not apply (CPU, other devices): ``act_quant`` +
    ``SetKAndS``, upstream's fallback, into the dense index-K pages and the owned pool rows.

    Returns False (nothing done) when the mode is off, or when the fused store applies: upstream then runs it
    with :func:`index_k_write_targets`.
    """
    batch = indexer_batch(forward_batch)
    if batch is None:
        return False
    from sglang.kernels.ops.kvcache import dsa_index_k_cache
    from sglang.kernels.ops.kvcache.dsa_fused_store_index_cache import can_use_dsa_fused_store

    if key.is_cuda and can_use_dsa_fused_store(key.dtype, torch.int64, pool.index_page_size):
        return False
    check_cache_write_rows(batch.plan, key.shape[0], f"layer {layer_id} index-K store")
    if act_quant is None:
        raise CpSharedKvError(f"layer {layer_id}: no fused index-K store here and no act_quant to quantize the keys")
    index_k, index_k_scale = act_quant(key, block_size, scale_fmt)
    for buffer, locs in _index_k_targets(batch, pool, layer_id):
        dsa_index_k_cache.SetKAndS.execute(
            pool=pool, buf=buffer, loc=locs, index_k=index_k, index_k_scale=index_k_scale
        )
    return True


def index_k_and_scale(
    pool: Any,
    forward_batch: Any,
    layer_id: int,
    seq_len_tensor: torch.Tensor,
    block_tables: torch.Tensor,
    seq_len_sum: int,
    max_seq_len: int,
):
    """The indexer's index-K read: the pool's when off, else the layer's dense index-K pages (same reader)."""
    batch = indexer_batch(forward_batch)
    if batch is None:
        return pool.get_index_k_scale_buffer(layer_id, seq_len_tensor, block_tables, seq_len_sum, max_seq_len)
    if batch.index_k_stored_layer != layer_id:
        raise CpSharedKvError(
            f"layer {layer_id}: index K read before the layer stored its current keys in the dense view"
        )
    from sglang.kernels.ops.kvcache import dsa_index_k_cache

    return dsa_index_k_cache.GetKAndS.execute(
        pool,
        batch.pipeline.dense_pages(INDEX_K, layer_id),
        page_indices=block_tables,
        seq_len_tensor=seq_len_tensor,
        seq_len_sum=seq_len_sum,
        max_seq_len=max_seq_len,
    )
