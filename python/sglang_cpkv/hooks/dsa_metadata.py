"""The plan hook of the DSA backend's ``init_forward_metadata`` and the tables that follow the dense layout.

Called from ``patches/core/hook-cp-shared-kv-into-dsa-extend.patch`` (:func:`on_extend_metadata`: begins the batch on
the backend's :class:`~.dsa_batch.BackendState`, returns the selected-request page table remapped to dense
locations), ``patches/core/follow-the-dense-layout-in-dsa-checks.patch`` (:func:`page_table_capacity`,
:func:`page_table_rows_bound`, :func:`current_chunk_locations`: the capacity check, its bound known on the host, and
the no-prefix RAGGED chunk table follow the dense layout) and ``patches/core/remap-mtp-seed-under-cp-shared-kv.patch``
(:func:`mtp_seed_pool_locations`: a fused top-k seed back to pool locations). Every hook returns upstream's own value
when the flag is off. Design: ``docs/design/cp-shared-kv.md`` sections 3, 4 and 7.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from sglang_cpkv.hooks import state
from sglang_cpkv.hooks.dsa_batch import STATE_ATTR, BackendState, ExtendBatch, backend_state, extend_batch
from sglang_cpkv.hooks.exchange_group import exchange_group
from sglang_cpkv.hooks.page_ids import page_id_capacity
from sglang_cpkv.hooks.settings import FLAG, enabled
from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime import SingleRankGroup, build_plan
from sglang_cpkv.runtime.cp_split import build_cp_split, upstream_interleave_split
from sglang_cpkv.runtime.plan import dense_to_pool_locs


def pool_page_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, longest: int, page_size: int
) -> torch.Tensor:
    """``[R, W]`` page ids of each request (``W = ceil(longest / page_size)``, ``longest`` the batch's longest
    history + current tokens) from upstream's token-level ``req_to_token`` (the location of a page's first token,
    divided by the page size)."""
    width = -(-longest // page_size)
    first_locs = req_to_token[req_pool_indices.to(req_to_token.device), : width * page_size : page_size]
    return torch.div(first_locs, page_size, rounding_mode="floor")  # upstream's dtype (int32): C fits


def on_extend_metadata(
    backend: Any, forward_batch: Any, page_table: torch.Tensor, bs_idx: torch.Tensor | None
) -> torch.Tensor:
    """Begin the batch; return ``page_table`` (the selected requests' token locations) remapped.

    Args:
        page_table: upstream's ``[rows, max_seqlen_k]`` token-location table after the CP cut.
        bs_idx: the batch row of each of its rows (upstream's ``bs_idx``), None when not cut.
    """
    if not enabled():
        return page_table
    from sglang.srt.layers.attention.dsa.utils import can_dsa_prefill_cp_interleave

    pool = backend.token_to_kv_pool
    page_size = pool.page_size
    prefix_lens, extend_lens = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    config = state.config()
    reservation = config.reservation
    # The CP group the reservation was made for: its exchange group under CP (made at start-up), else this rank alone.
    group = exchange_group() if reservation.cp_size > 1 else SingleRankGroup()
    if can_dsa_prefill_cp_interleave(forward_batch):  # the split upstream ran, from its metadata
        metadata = forward_batch.attn_cp_metadata
        split = upstream_interleave_split(
            sum(extend_lens), metadata.per_rank_logical_token, metadata.per_rank_actual_token, group.cp_rank
        )
    else:  # upstream runs the batch un-split on every rank
        split = build_cp_split("none", extend_lens, group.cp_size, group.cp_rank)
    plan = build_plan(
        pool_page_table(
            backend.req_to_token,
            forward_batch.req_pool_indices,
            max(map(operator.add, prefix_lens, extend_lens)),
            page_size,
        ),
        prefix_lens,
        extend_lens,
        # Upstream cuts it to the real tokens under CP; an un-split batch may carry MLP-sync padding.
        forward_batch.out_cache_loc[: sum(extend_lens)],
        capacity=page_id_capacity(pool),
        page_size=page_size,
        split=split,
        checked=config.checked,
        staging=backend_state(backend).plan_staging(reservation, forward_batch.out_cache_loc.device),
    )
    reservation.check_batch(plan.needed_slots * page_size, plan.num_slots, plan.num_tokens, plan.entries)
    batch = backend_state(backend).begin(backend, forward_batch, plan, group, reservation)
    return remap_page_table(batch, page_table, bs_idx)


def remap_page_table(batch: ExtendBatch, page_table: torch.Tensor, bs_idx: torch.Tensor | None) -> torch.Tensor:
    """Token locations of each row's request -> dense locations (row ``i`` is request ``bs_idx[i]``), in place.

    Upstream's ``[rows, max_seqlen_k]`` table is its own copy (an advanced index of ``req_to_token``, and of its rows
    under CP) that nothing reads as pool locations after this hook (every table of the batch derives from the one
    returned), so it is remapped where it is: the mode allocates no second table, which the reservation could not
    bound (rows x the longest request, not the batch's dense tokens).

    Raises:
        CpSharedKvError: the table is a view (of ``req_to_token``: remapping it would corrupt the request's pool
            locations) or not contiguous int32 (an upstream change; see ``docs/design/cp-shared-kv.md``).
    """
    if page_table._base is not None or page_table.dtype != torch.int32 or not page_table.is_contiguous():
        raise CpSharedKvError(
            f"{FLAG}: upstream's page table is no longer its own contiguous int32 copy ({page_table.dtype}, "
            f"view: {page_table._base is not None}, contiguous: {page_table.is_contiguous()}); it cannot be remapped "
            "in place"
        )
    rows = page_table.shape[0]
    if bs_idx is None:
        row_req = torch.arange(rows, dtype=torch.int64, device=page_table.device)
    else:
        row_req = bs_idx.to(device=page_table.device, dtype=torch.int64)
    return batch.pipeline.remap(page_table, row_req, out=page_table)


def page_table_capacity(backend: Any, forward_batch: Any, pool_capacity: int) -> int:
    """The rows ``page_table_1_flattened`` indexes: the dense view's under the mode (its tables hold dense
    locations), the pool's (``pool_capacity``) otherwise."""
    batch = extend_batch(backend, forward_batch)
    return pool_capacity if batch is None else batch.plan.dense_rows


def page_table_rows_bound(backend: Any, forward_batch: Any, seq_lens_sum: int) -> int:
    """A host bound of the rows ``page_table_1_flattened`` addresses, for upstream's capacity check, which reads the
    table's max from the device only when this bound exceeds :func:`page_table_capacity`: ``seq_lens_sum`` when off;
    under the mode the dense view's rows, since every entry of the remapped table is -1 or a location of a slot of
    the view (``remap_locs``: ``slot * page_size + offset``, ``slot < num_slots``; checked mode asserts it). A shared
    prompt is one copy in the view but counted once per request in ``seq_lens_sum``, so upstream's own bound would
    take its device read for every batch that shares a cached prefix."""
    batch = extend_batch(backend, forward_batch)
    return seq_lens_sum if batch is None else batch.plan.dense_rows


def current_chunk_locations(backend: Any, forward_batch: Any, out_cache_loc: torch.Tensor) -> torch.Tensor:
    """Where the current chunk's tokens live for readers of the batch's tables: ``out_cache_loc`` (pool locations)
    when off, their dense-view locations under the mode (the layout every other table of the batch uses)."""
    batch = extend_batch(backend, forward_batch)
    return out_cache_loc if batch is None else batch.plan.current_dense_locs


def mtp_seed_pool_locations(backend: Any, seed: torch.Tensor, forward_mode: Any) -> torch.Tensor:
    """``prepare_mtp_seed_indices``'s result with dense locations turned back into pool locations.

    In the mode the fused top-k of an extend batch addresses the per-request dense view (PAGED: the
    top-k itself; RAGGED: upstream's lookup through ``page_table_1_flattened``, which holds dense
    locations), while the draft decode that consumes the seed reads the pool. Unfused seeds are
    request-local positions (upstream exports them as they are) and stay untouched, as does every seed
    with the mode off or of a forward the plan hook did not begin.
    """
    state: BackendState | None = getattr(backend, STATE_ATTR, None)
    batch = None if state is None else state.batch
    if batch is None or not backend.use_fused_topk or not forward_mode.is_extend_without_speculative():
        return seed
    return dense_to_pool_locs(batch.plan, seed)
