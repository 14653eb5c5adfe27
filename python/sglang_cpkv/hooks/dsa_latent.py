"""The latent KV of a DSA layer under the mode: its dense view, and this rank's owned rows persisted.

Called from ``patches/core/hook-cp-shared-kv-into-dsa-extend.patch`` where ``forward_extend`` writes the cache
(design: ``docs/design/cp-shared-kv.md`` section 4); returns None with the flag off, and upstream writes and reads
its pool as before.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_cpkv.hooks.cache_write import check_cache_write_rows
from sglang_cpkv.hooks.dsa_batch import LATENT, extend_batch
from sglang_cpkv.ops.errors import CpSharedKvError


def extend_dense_kv(
    backend: Any,
    layer_id: int,
    forward_batch: Any,
    k: torch.Tensor | None,
    k_rope: torch.Tensor | None,
    save_kv_cache: bool,
) -> torch.Tensor | None:
    """The layer's dense KV view (history + current), in the dtype ``get_key_buffer`` returns; None when off.

    Called where ``forward_extend`` writes the cache. ``k``/``k_rope`` are the all-gathered current rows; upstream's
    own writer turns them into the pool's row format once (bf16, FP8, or the packed 656-byte FP8 layout alike), into
    a scratch: the dense view is filled from it, and - after the view took the layer's history - this rank's owned
    rows are persisted from it too, so ``forward_extend`` skips its own cache write (one quantization, not two).
    On a batch whose route never reads the view (:func:`reads_dense_latent`) the owned rows are written straight
    to the pool and the pool's buffer is returned (not read there either), so no dense latent view exists.
    """
    batch = extend_batch(backend, forward_batch)
    if batch is None:
        return None
    if k is None:
        raise CpSharedKvError(f"layer {layer_id}: CP shared-KV needs the current KV of the extend (k is None)")
    check_cache_write_rows(batch.plan, k.shape[0], f"layer {layer_id} dense fill")
    pool = backend.token_to_kv_pool
    if batch.latent_scratch is None:
        # The route attends over the current rows themselves and the batch has no history: no dense view,
        # only this rank's owned rows persisted (upstream's writer, non-owned rows to its skipped location 0).
        if save_kv_cache:
            pool._write_mla_kv_buffer(pool.kv_buffer[layer_id - pool.start_layer], batch.pool_write_locs, k, k_rope)
        return pool.get_key_buffer(layer_id)
    pool._write_mla_kv_buffer(batch.latent_scratch, batch.latent_scratch_locs, k, k_rope)
    current_rows = batch.latent_scratch[1:]
    dense_kv = batch.pipeline.dense_view(LATENT, layer_id, current_rows)
    if save_kv_cache:
        batch.pipeline.persist_owned(LATENT, layer_id, current_rows)
    if pool.store_dtype != pool.dtype:
        return dense_kv.view(pool.dtype)
    return dense_kv
