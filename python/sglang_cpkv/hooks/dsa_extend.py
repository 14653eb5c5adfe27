"""Hooks of the DSA attention backend and indexer for ``--enable-cp-shared-kv`` (0.5.23).

Called from ``patches/core/hook-cp-shared-kv-into-dsa-extend.patch`` (design:
``docs/design/cp-shared-kv.md`` sections 3-5). Every hook is a no-op that returns upstream's own
value unless the flag is on *and* the batch is an extend batch with a plan:

* :func:`on_extend_metadata` - ``DeepseekSparseAttnBackend.init_forward_metadata``, EXTEND branch,
  after upstream's CP cut: builds the batch plan (``sglang_cpkv.runtime.build_plan``) from the
  batch's page table, lengths and ``out_cache_loc``; checks its split against upstream's
  ``attn_cp_metadata``; returns the selected-request page table remapped to dense locations, so
  that every table upstream derives from it (``real_page_table``, ``page_table_1_flattened``, the
  fused top-k transform's output) addresses the per-request dense view.
* :func:`extend_dense_kv` - ``forward_extend`` before the cache write: takes the layer's history
  (owned pages from the pool, others all-gathered from their owners; materialized one layer ahead
  by :class:`~sglang_cpkv.hooks.layer_history.LayerAheadHistory`) and fills the current chunk
  into the dense view; ``forward_extend`` reads it instead of the pool.
* :func:`cache_write_locs` - ``forward_extend``'s ``set_mla_kv_buffer``: only owned rows
  (:mod:`.cache_write`).
* :func:`store_index_k` / :func:`index_k_and_scale` - the indexer's index-K store and read: the same
  dense view for index K (history + current), owned rows persisted.
* :func:`on_attn_cp_group_created` - ``initialize_model_parallel``, right after upstream's
  attention-CP group: the history exchange's own process group (same ranks).
* :func:`mtp_seed_pool_locations` - ``prepare_mtp_seed_indices``: an MTP IndexShare seed exported
  from a fused top-k addresses the dense view; the draft decode needs pool locations.

Order within a layer: the dense view is built from the pool *before* this rank's owned rows are
persisted, so a page id that one request reads as history and another writes as current (possible
with allocators that share partial pages, contract "Which states matter") never changes history.

The first layer of a batch materializes its own history (latent and index K together, whichever
hook of the layer comes first) and starts the next layer's on the prefetch stream; each layer then
starts the one after it (design section 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sglang_cpkv.hooks import layer_history
from sglang_cpkv.hooks.cache_write import (
    check_cache_write_rows,
    check_split_matches_upstream,
    owned_pool_write_locs,
)
from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE, CpSharedKvError
from sglang_cpkv.runtime.group import CpGroup, SingleRankGroup
from sglang_cpkv.runtime.layer import fill_current, remap_topk
from sglang_cpkv.runtime.plan import CpSharedKvPlan, build_plan

# ForwardBatch attribute holding the batch's ExtendBatchState (absent or None: the mode is off).
BATCH_ATTR = "cp_shared_kv_batch"


@dataclass
class ExtendBatchState:
    """What the layers of one extend batch share: the plan, the exchange's CP group, the history
    prefetch (made at the batch's first layer) and the current-row scratch."""

    plan: CpSharedKvPlan
    group: CpGroup
    pool_write_locs: torch.Tensor
    history: layer_history.LayerAheadHistory | None = None
    current_scratch: torch.Tensor | None = None
    index_k_stored_layer: int | None = None  # the last layer whose current index K is in its dense view


_ENABLED: bool | None = None
# The last extend batch's plan, whose device error counter the next batch checks.
_previous_plan: CpSharedKvPlan | None = None


def enabled() -> bool:
    """Whether this server runs with ``--enable-cp-shared-kv`` (read once the server args are published)."""
    global _ENABLED
    if _ENABLED is None:
        from sglang.srt.runtime_context import get_server_args

        try:
            server_args = get_server_args()
        except ValueError:  # not published in this process (yet): the mode is off, ask again later
            return False
        _ENABLED = bool(getattr(server_args, "enable_cp_shared_kv", False))
    return _ENABLED


def batch_state(forward_batch: Any) -> ExtendBatchState | None:
    return getattr(forward_batch, BATCH_ATTR, None)


def pool_page_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: Sequence[int], page_size: int
) -> torch.Tensor:
    """``[R, W]`` page ids of each request (``W = ceil(max seq_len / page_size)``) from upstream's
    token-level ``req_to_token`` (the location of a page's first token, divided by the page size)."""
    width = -(-max(int(n) for n in seq_lens) // page_size)
    first_locs = req_to_token[req_pool_indices.to(req_to_token.device), : width * page_size : page_size]
    return torch.div(first_locs.to(torch.int64), page_size, rounding_mode="floor")


def build_extend_state(
    *,
    pool: Any,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    strategy: str,
    group: CpGroup,
    upstream_split: tuple[Sequence[int], Sequence[int]] | None = None,
) -> ExtendBatchState:
    """The batch state from upstream's objects (``MLATokenToKVPool``-like ``pool``, ``req_to_token``).

    Args:
        upstream_split: ``(per_rank_logical_token, per_rank_actual_token)`` of upstream's
            ``attn_cp_metadata`` when the batch is split; the plan must agree with it.
    """
    page_size = pool.page_size
    seq_lens = [int(p) + int(e) for p, e in zip(prefix_lens, extend_lens)]
    table = pool_page_table(req_to_token, req_pool_indices, seq_lens, page_size)
    plan = build_plan(
        table,
        prefix_lens,
        extend_lens,
        out_cache_loc,
        capacity=(pool.size + page_size) // page_size,
        page_size=page_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        strategy=strategy,
    )
    if upstream_split is not None:
        check_split_matches_upstream(plan, *upstream_split)
    return ExtendBatchState(plan=plan, group=group, pool_write_locs=owned_pool_write_locs(plan))


def on_attn_cp_group_created(attn_cp_group: Any) -> None:
    """Make the history exchange's own process group over upstream's attention-CP ranks (mode on, cp > 1).

    Called by every rank right after ``initialize_model_parallel`` builds its attention-CP
    ``GroupCoordinator``: the exchange runs on the prefetch stream, and a communicator of its own
    keeps its all-gathers from interleaving with the model's collectives on upstream's groups.
    """
    if not enabled() or attn_cp_group.world_size <= 1:
        return
    import torch.distributed as dist

    layer_history.create_exchange_group(list(attn_cp_group.ranks), dist.get_backend(attn_cp_group.device_group))


def _exchange_group() -> CpGroup:
    return layer_history.exchange_group()


def on_extend_metadata(
    backend: Any, forward_batch: Any, page_table: torch.Tensor, bs_idx: torch.Tensor | None
) -> torch.Tensor:
    """Build the batch plan; return ``page_table`` (selected requests' token locations) remapped.

    Args:
        page_table: upstream's ``[rows, max_seqlen_k]`` token-location table after the CP cut.
        bs_idx: the batch row of each of its rows (upstream's ``bs_idx``), None when not cut.
    """
    setattr(forward_batch, BATCH_ATTR, None)
    backend.cp_shared_kv_batch = None
    if not enabled():
        return page_table
    global _previous_plan
    if _previous_plan is not None:
        # The natural sync point of the contract: bad ids the previous batch's ops dropped surface here.
        previous, _previous_plan = _previous_plan, None
        previous.raise_if_errors("previous CP shared-KV extend batch")
    from sglang.srt.layers.attention.dsa.utils import can_dsa_prefill_cp_interleave
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    split = can_dsa_prefill_cp_interleave(forward_batch)
    metadata = forward_batch.attn_cp_metadata
    state = build_extend_state(
        pool=backend.token_to_kv_pool,
        req_to_token=backend.req_to_token,
        req_pool_indices=forward_batch.req_pool_indices,
        prefix_lens=forward_batch.extend_prefix_lens_cpu,
        extend_lens=forward_batch.extend_seq_lens_cpu,
        # Upstream cuts it to the real tokens under CP; an un-split batch may carry MLP-sync padding.
        out_cache_loc=forward_batch.out_cache_loc[: sum(forward_batch.extend_seq_lens_cpu)],
        cp_size=parallel.attn_cp_size,
        cp_rank=parallel.attn_cp_rank,
        strategy="interleave" if split else "none",
        group=_exchange_group() if parallel.attn_cp_size > 1 else SingleRankGroup(),
        upstream_split=(metadata.per_rank_logical_token, metadata.per_rank_actual_token) if split else None,
    )
    setattr(forward_batch, BATCH_ATTR, state)
    # prepare_mtp_seed_indices sees the backend, not the batch.
    backend.cp_shared_kv_batch = state
    _previous_plan = state.plan
    return remap_page_table(state.plan, page_table, bs_idx)


def remap_page_table(plan: CpSharedKvPlan, page_table: torch.Tensor, bs_idx: torch.Tensor | None) -> torch.Tensor:
    """Token locations of each row's request -> dense locations (row ``i`` is request ``bs_idx[i]``)."""
    rows = page_table.shape[0]
    if bs_idx is None:
        row_req = torch.arange(rows, dtype=torch.int64, device=page_table.device)
    else:
        row_req = bs_idx.to(device=page_table.device, dtype=torch.int64)
    return remap_topk(plan, page_table, row_req).to(page_table.dtype)


def _layer_history(state: ExtendBatchState, pool: Any, layer_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's dense latent KV and index-K pages with its history in them (one layer ahead)."""
    if state.history is None:
        state.history = layer_history.LayerAheadHistory(state.plan, state.group, pool)
    elif state.history.pool is not pool:
        raise CpSharedKvError(f"layer {layer_id}: one extend batch reads two KV pools")
    return state.history.acquire(layer_id)


def extend_dense_kv(
    pool: Any, layer_id: int, forward_batch: Any, k: torch.Tensor | None, k_rope: torch.Tensor | None
) -> torch.Tensor | None:
    """The layer's dense KV view (history + current), in the dtype ``get_key_buffer`` returns; None when off.

    Call before the layer's cache write. ``k``/``k_rope`` are the all-gathered current rows that
    ``forward_extend`` hands ``set_mla_kv_buffer``; they are converted to the pool's row format by
    upstream's own writer (bf16, FP8, or the packed 656-byte FP8 layout alike).
    """
    state = batch_state(forward_batch)
    if state is None:
        return None
    if k is None:
        raise CpSharedKvError(f"layer {layer_id}: CP shared-KV needs the current KV of the extend (k is None)")
    plan = state.plan
    check_cache_write_rows(plan, k.shape[0], f"layer {layer_id} dense fill")
    dense_kv, _ = _layer_history(state, pool, layer_id)
    if state.current_scratch is None:
        # Upstream's writer skips location 0, so the N current rows land at 1..N of a scratch.
        state.current_scratch = torch.empty(
            (plan.num_tokens + 1, *dense_kv.shape[1:]), dtype=dense_kv.dtype, device=dense_kv.device
        )
    scratch = state.current_scratch
    scratch_locs = torch.arange(1, plan.num_tokens + 1, dtype=torch.int64, device=dense_kv.device)
    pool._write_mla_kv_buffer(scratch, scratch_locs, k, k_rope)
    fill_current(plan, scratch[1:], dense_kv)
    if pool.store_dtype != pool.dtype:
        return dense_kv.view(pool.dtype)
    return dense_kv


def cache_write_locs(forward_batch: Any, cache_loc: torch.Tensor, kv_rows: int) -> torch.Tensor:
    """``cache_loc`` when off; else this rank's owned rows (others at upstream's skipped location 0)."""
    state = batch_state(forward_batch)
    if state is None:
        return cache_loc
    check_cache_write_rows(state.plan, kv_rows, "set_mla_kv_buffer")
    return state.pool_write_locs


_index_k_pages = layer_history.index_k_pages_as_rows


def store_index_k(
    pool: Any, forward_batch: Any, layer_id: int, key: torch.Tensor, act_quant: Any, block_size: int, scale_fmt: Any
) -> bool:
    """Index-K store in the mode: dense view (history, then current), then owned rows to the pool.

    Uses the store upstream's ``_store_index_k_cache`` would: the fused CUDA store when it applies,
    else ``act_quant`` + ``SetKAndS`` (its fallback, which also runs on CPU).
    Returns False (nothing done) when the mode is off, so the indexer runs upstream's store.
    """
    state = batch_state(forward_batch)
    if state is None:
        return False
    from sglang.kernels.ops.kvcache import dsa_index_k_cache
    from sglang.kernels.ops.kvcache.dsa_fused_store_index_cache import (
        can_use_dsa_fused_store,
        fused_store_index_k_cache,
    )

    plan = state.plan
    check_cache_write_rows(plan, key.shape[0], f"layer {layer_id} index-K store")
    page_size = pool.index_page_size
    pool_pages = pool.get_index_k_with_scale_buffer(layer_id)
    _, dense_index_k = _layer_history(state, pool, layer_id)
    dense_locs = plan.current_dense_locs.to(torch.int64)
    owned_locs = state.pool_write_locs.to(torch.int64)
    if key.is_cuda and can_use_dsa_fused_store(key.dtype, torch.int64, page_size):
        fused_store_index_k_cache(key, dense_index_k, dense_locs, page_size)
        fused_store_index_k_cache(key, pool_pages, owned_locs, page_size)
        state.index_k_stored_layer = layer_id
        return True
    if act_quant is None:
        raise CpSharedKvError(f"layer {layer_id}: no fused index-K store here and no act_quant to quantize the keys")
    index_k, index_k_scale = act_quant(key, block_size, scale_fmt)
    dsa_index_k_cache.SetKAndS.execute(
        pool=pool, buf=dense_index_k, loc=dense_locs, index_k=index_k, index_k_scale=index_k_scale
    )
    pool.set_index_k_scale_buffer(layer_id=layer_id, loc=owned_locs, index_k=index_k, index_k_scale=index_k_scale)
    state.index_k_stored_layer = layer_id
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
    """The indexer's index-K read: the pool's when off, else the layer's dense index-K view (same reader)."""
    state = batch_state(forward_batch)
    if state is None:
        return pool.get_index_k_scale_buffer(layer_id, seq_len_tensor, block_tables, seq_len_sum, max_seq_len)
    if state.index_k_stored_layer != layer_id:
        raise CpSharedKvError(
            f"layer {layer_id}: index K read before the layer stored its current keys in the dense view"
        )
    _, dense_index_k = _layer_history(state, pool, layer_id)
    from sglang.kernels.ops.kvcache import dsa_index_k_cache

    return dsa_index_k_cache.GetKAndS.execute(
        pool,
        dense_index_k,
        page_indices=block_tables,
        seq_len_tensor=seq_len_tensor,
        seq_len_sum=seq_len_sum,
        max_seq_len=max_seq_len,
    )


def dense_to_pool_locs(plan: CpSharedKvPlan, dense_locs: torch.Tensor) -> torch.Tensor:
    """Dense-view locations back to pool locations through the plan (-1 stays -1).

    Dense location ``d`` of request ``r = d // (P * page_size)`` is slot ``j = d // page_size - r * P``,
    whose page is ``plan.page_table[r, j]``: pool location ``page_table[r, j] * page_size + d % page_size``.
    A location outside the plan's dense view or on a slot past its request's pages maps to -1
    (and counts as a bad id in the plan's error counter, surfaced at the next batch).
    """
    page_size = plan.page_size
    locs = dense_locs.to(torch.int64)
    in_view = (locs >= 0) & (locs < plan.dense_rows)
    slot = torch.div(torch.where(in_view, locs, torch.zeros_like(locs)), page_size, rounding_mode="floor")
    page = plan.page_table.to(torch.int64).reshape(-1)[slot]
    mapped = in_view & (page >= 0)
    # No host sync: a bad location is counted on the device, like the ops' own errors.
    plan.errors[ERR_LOC_OUT_OF_RANGE] += ((locs >= 0) & ~mapped).sum().to(plan.errors.dtype)
    pool = page * page_size + locs % page_size
    return torch.where(mapped, pool, torch.full_like(pool, -1)).to(dense_locs.dtype)


def mtp_seed_pool_locations(backend: Any, seed: torch.Tensor, forward_mode: Any) -> torch.Tensor:
    """``prepare_mtp_seed_indices``'s result with dense locations turned back into pool locations.

    In the mode the fused top-k of an extend batch addresses the per-request dense view (PAGED:
    the top-k itself; RAGGED: upstream's lookup through ``page_table_1_flattened``, which holds dense
    locations), while the draft decode that consumes the seed reads the pool. Unfused seeds are
    request-local positions (upstream exports them as they are) and stay untouched, as does every
    seed with the mode off or of a batch the plan hook did not see.
    """
    state: ExtendBatchState | None = getattr(backend, BATCH_ATTR, None)
    if state is None or not backend.use_fused_topk or not forward_mode.is_extend_without_speculative():
        return seed
    return dense_to_pool_locs(state.plan, seed)
