"""Hooks of the DSA attention backend and indexer for ``--enable-cp-shared-kv`` (0.5.23).

Called from ``patches/core/hook-cp-shared-kv-into-dsa-extend.patch`` and
``patches/core/remap-mtp-seed-under-cp-shared-kv.patch`` (design: ``docs/design/cp-shared-kv.md``
sections 3-7). Every hook returns upstream's own value when the flag is off; with it on, an extend forward the
plan hook did not begin on the backend is refused (:func:`extend_batch`: its pool holds only owned pages). The per-layer work is the runtime's
:class:`~sglang_cpkv.runtime.LayerPipeline`; these hooks only translate upstream's objects into its
inputs:

* :func:`on_extend_metadata` - ``DeepseekSparseAttnBackend.init_forward_metadata``, EXTEND branch,
  after upstream's CP cut: begins the batch (plan, pipeline) on the backend's :class:`BackendState` and
  returns the selected-request page table remapped to dense locations, so that every table upstream
  derives from it (``real_page_table``, ``page_table_1_flattened``, the fused top-k transform's output)
  addresses the per-request dense view.
* :func:`extend_dense_kv` - ``forward_extend`` at the cache write: the layer's dense latent view (history
  from the owners, then the current rows in the pool's row format, made once by upstream's own writer),
  and this rank's owned rows persisted from the same rows (upstream's own write is skipped).
* :func:`index_k_write_targets` (upstream's fused index-K stores), :func:`store_index_k` (its fallback) and
  :func:`index_k_and_scale` (the read) - the indexer's index K: the dense index-K pages (history, then the
  current keys stored by upstream's own kernels), owned rows persisted.
* :func:`page_table_capacity` / :func:`current_chunk_locations` - the metadata's capacity check and the
  no-prefix RAGGED chunk table follow the dense layout.
* :func:`mtp_seed_pool_locations` - ``prepare_mtp_seed_indices``: a fused top-k seed addresses the
  dense view; the draft decode needs pool locations.

Batch state lives in one object, the :class:`ExtendBatch` of the backend's :class:`BackendState`
(``backend.cp_shared_kv``), from the plan hook to the next one; the indexer finds the backend the way
upstream's indexer does (``get_attn_backend()`` of the forward context). No module global holds a batch.

Errors: bad ids the batch's ops dropped are counted on the device (contract, "Errors and
synchronization"); raising at the batch's own end would need a host sync after its last layer, which
stalls the scheduler's overlap of the next batch's preparation. So the counter is copied to pinned host
memory without a sync when the next batch begins, and read as soon as that copy has landed (at the
begin of a later batch): the error names the batch it belongs to. Checked mode raises at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sglang_cpkv.hooks.cache_write import check_cache_write_rows, check_split_matches_upstream, owned_pool_write_locs
from sglang_cpkv.hooks.exchange_group import exchange_group
from sglang_cpkv.hooks.page_ids import page_id_capacity
from sglang_cpkv.hooks.reservation import published as reserved_buffers
from sglang_cpkv.hooks.settings import FLAG, enabled
from sglang_cpkv.ops.errors import CpSharedKvError, describe_errors
from sglang_cpkv.runtime import (
    CpGroup,
    CpSharedKvPlan,
    LayerPipeline,
    PagedKind,
    SingleRankGroup,
    as_pages,
    build_plan,
)
from sglang_cpkv.runtime.plan import dense_to_pool_locs
from sglang_cpkv.runtime.reservation import Reservation

# The backend attribute that holds its BackendState (absent: the mode never ran on it).
STATE_ATTR = "cp_shared_kv"
LATENT, INDEX_K = "latent", "index_k"

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """One prefetch stream per device: the exchange group's collectives are issued from it only, so the
    target's and the draft's pipelines (one communicator) run their all-gathers in start order."""
    if device.type != "cuda":
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def pool_page_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: Sequence[int], page_size: int
) -> torch.Tensor:
    """``[R, W]`` page ids of each request (``W = ceil(max seq_len / page_size)``) from upstream's
    token-level ``req_to_token`` (the location of a page's first token, divided by the page size)."""
    width = -(-max(int(n) for n in seq_lens) // page_size)
    first_locs = req_to_token[req_pool_indices.to(req_to_token.device), : width * page_size : page_size]
    return torch.div(first_locs.to(torch.int64), page_size, rounding_mode="floor")


class ReservedBuffers:
    """The mode's buffers of one backend, allocated once at the size the reservation gives them.

    :meth:`get` returns ``count`` buffers of ``pages`` pages per (name, page shape, dtype, device); every batch
    gets the same ones (the pipeline uses the first ``num_slots`` pages). A batch may reuse what the previous one
    read: its prefetch stream waits for the current stream before it writes (:class:`LayerPipeline`).
    """

    def __init__(self) -> None:
        self._held: dict[tuple, list[torch.Tensor]] = {}

    def get(self, name: str, pages: int, page_elems: int, dtype: torch.dtype, device: torch.device, count: int):
        key = (name, page_elems, dtype, torch.device(device))
        held = self._held.get(key, [])
        if len(held) != count or held[0].shape[0] != pages:  # first use (or another reservation: tests)
            held = [torch.empty((pages, page_elems), dtype=dtype, device=device) for _ in range(count)]
            self._held[key] = held
        return tuple(held)

    def held_bytes(self, prefix: str) -> int:
        """Bytes of the buffers held under names starting with ``prefix`` (``"latent"``: its views and scratch)."""
        return sum(b.nbytes for key, held in self._held.items() if key[0].startswith(prefix) for b in held)


@dataclass
class ExtendBatch:
    """One extend batch of one backend: its plan, its pipeline and the values its layers share."""

    number: int  # the backend's extend batches, counted from 1 (errors name it)
    forward_batch: weakref.ref
    plan: CpSharedKvPlan
    pipeline: LayerPipeline
    pool_write_locs: torch.Tensor  # owned rows' pool locations, others upstream's skipped location 0
    # [N + 1, row] and 1..N (upstream's writer skips location 0, rows land at 1..N); None when the batch's
    # route never reads a dense latent view (:func:`reads_dense_latent`).
    latent_scratch: torch.Tensor | None
    latent_scratch_locs: torch.Tensor | None
    index_k_stored_layer: int | None = None  # the last layer whose current keys are in the dense index-K view


class _ErrorsInTransit:
    """A batch's device error counter on its way to the host, without a synchronization."""

    def __init__(self, batch: ExtendBatch) -> None:
        errors = batch.plan.errors
        self.where = f"CP shared-KV extend batch {batch.number} ({batch.plan.num_requests} requests)"
        self.host = torch.empty(errors.shape, dtype=errors.dtype, pin_memory=errors.is_cuda)
        self.host.copy_(errors, non_blocking=True)
        self.event = None
        if errors.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def landed(self) -> bool:
        return self.event is None or self.event.query()


class BackendState:
    """The mode's state on one DSA attention backend (the target's, or a draft's): the dense buffers it
    reuses across batches, the batch in flight, and earlier batches' error counters in transit."""

    def __init__(self) -> None:
        self.buffers = ReservedBuffers()
        self.batch: ExtendBatch | None = None
        self.batches_begun = 0
        self._in_transit: list[_ErrorsInTransit] = []

    def surface_errors(self) -> None:
        """Raise, once, for the earlier batches whose counters have reached the host and show dropped ids; the
        counters still in transit stay for a later batch. A batch's error is raised by one later batch only."""
        landed = [errors.landed() for errors in self._in_transit]
        arrived = [errors for errors, done in zip(self._in_transit, landed) if done]
        self._in_transit = [errors for errors, done in zip(self._in_transit, landed) if not done]
        messages = [m for m in (describe_errors(errors.host, errors.where) for errors in arrived) if m]
        if messages:
            raise CpSharedKvError("; ".join(messages))

    def begin(
        self, backend: Any, forward_batch: Any, plan: CpSharedKvPlan, group: CpGroup, reservation: Reservation
    ) -> ExtendBatch:
        """End the previous batch (its counter goes to the host) and begin this one in the reserved buffers."""
        if self.batch is not None:
            self._in_transit.append(_ErrorsInTransit(self.batch))
            self.batch = None
        self.surface_errors()
        pool = backend.token_to_kv_pool
        latent = reads_dense_latent(backend, forward_batch)
        kinds = [self._latent_kind(pool, plan, reservation)] if latent else []
        index_k = self._index_k_kind(pool, plan, reservation)
        if index_k is not None:
            kinds.append(index_k)
        pipeline = LayerPipeline(
            plan, group, kinds, layer_ahead=reservation.layer_ahead, stream=_side_stream(plan.device)
        )
        scratch = scratch_locs = None
        if latent:
            first = pool.kv_buffer[0]
            (held,) = self.buffers.get(
                f"{LATENT}/scratch", reservation.chunk_tokens + 1, first[0].numel(), first.dtype, first.device, 1
            )
            scratch = held[: plan.num_tokens + 1].view(-1, *first.shape[1:])
            scratch_locs = torch.arange(1, plan.num_tokens + 1, dtype=torch.int64, device=plan.device)
        self.batches_begun += 1
        self.batch = ExtendBatch(
            number=self.batches_begun,
            forward_batch=weakref.ref(forward_batch),
            plan=plan,
            pipeline=pipeline,
            pool_write_locs=owned_pool_write_locs(plan),
            latent_scratch=scratch,
            latent_scratch_locs=scratch_locs,
        )
        return self.batch

    def _views(self, name: str, reservation: Reservation, page: torch.Tensor, token_bytes: int):
        """The reserved dense views of one kind whose pool pages look like ``page`` (under CP the history all-gather
        lands in them: no exchange buffer)."""
        page_bytes = page.numel() * page.element_size()
        if page_bytes != reservation.page_size * token_bytes:
            raise CpSharedKvError(
                f"{name}: the pool's pages are {page_bytes} bytes, the start-up reservation counted "
                f"{reservation.page_size} x {token_bytes}"
            )
        shape = (page.numel(), page.dtype, page.device)
        return self.buffers.get(name, reservation.dense_slots, *shape, reservation.views_per_kind)

    def _latent_kind(self, pool: Any, plan: CpSharedKvPlan, reservation: Reservation) -> PagedKind:
        first = pool.kv_buffer[0]
        page = first[: plan.page_size]
        views = self._views(LATENT, reservation, page, reservation.latent_token_bytes)
        return PagedKind(
            name=LATENT,
            layers=tuple(range(pool.start_layer, pool.start_layer + pool.layer_num)),
            pool_pages=lambda layer: as_pages(pool.kv_buffer[layer - pool.start_layer], plan.page_size, "KV pool"),
            buffers=views,
            row_shape=tuple(first.shape[1:]),
            row_dtype=first.dtype,
        )

    def _index_k_kind(self, pool: Any, plan: CpSharedKvPlan, reservation: Reservation) -> PagedKind | None:
        """Index-K pages of the layers that have them: an IndexShare layer reusing another layer's top-k has
        a 0-row index-K pool (``skip_topk_layers``) and never runs its indexer, so it is not listed."""
        if not hasattr(pool, "get_index_k_with_scale_buffer"):
            return None
        skip = list(getattr(pool, "skip_topk_layers", None) or [False] * pool.layer_num)
        layers = tuple(pool.start_layer + i for i in range(pool.layer_num) if not skip[i])
        if not layers:
            return None
        page = pool.get_index_k_with_scale_buffer(layers[0])[0]
        views = self._views(INDEX_K, reservation, page, reservation.index_k_token_bytes)
        return PagedKind(
            name=INDEX_K,
            layers=layers,
            pool_pages=pool.get_index_k_with_scale_buffer,
            buffers=views,
        )

    def batch_of(self, forward_batch: Any) -> ExtendBatch | None:
        """The batch the plan hook began for this ``forward_batch`` (None for any other forward)."""
        batch = self.batch
        if batch is None or batch.forward_batch() is not forward_batch:
            return None
        return batch


def reads_dense_latent(backend: Any, forward_batch: Any) -> bool:
    """Whether ``forward_extend`` reads the batch's dense latent view: on every route but RAGGED on a batch
    without a cached prefix, which attends over ``cat(k, k_rope)`` of the current rows (upstream's
    ``_has_prefix = any(forward_batch.extend_prefix_lens_cpu)``, host data) and reads no KV cache."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    ragged = backend.get_topk_transform_method(forward_batch.forward_mode) == TopkTransformMethod.RAGGED
    return not ragged or any(forward_batch.extend_prefix_lens_cpu)


def backend_state(backend: Any) -> BackendState:
    state = getattr(backend, STATE_ATTR, None)
    if state is None:
        state = BackendState()
        setattr(backend, STATE_ATTR, state)
    return state


def extend_batch(backend: Any, forward_batch: Any) -> ExtendBatch | None:
    """The mode's batch for this extend forward of ``backend``; None when the mode is off.

    Raises:
        CpSharedKvError: the mode is on and the plan hook did not begin this ``forward_batch`` on ``backend``:
            under the mode the pool holds only this rank's owned pages and the metadata tables (built for the
            batch the plan began) hold dense locations, so upstream's pool path would read wrong rows.
    """
    state = getattr(backend, STATE_ATTR, None)
    batch = None if state is None else state.batch_of(forward_batch)
    if batch is None and enabled():
        began = "no batch" if state is None or state.batch is None else f"batch {state.batch.number}"
        raise CpSharedKvError(
            f"{FLAG}: an extend forward ran with a forward batch the CP shared-KV plan hook did not begin on this "
            f"backend (it began {began}); its KV would be read from the owner-sharded pool"
        )
    return batch


def _indexer_batch(forward_batch: Any) -> ExtendBatch | None:
    from sglang.srt.model_executor.forward_context import get_attn_backend

    return extend_batch(get_attn_backend(), forward_batch)


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

    split = can_dsa_prefill_cp_interleave(forward_batch)
    pool = backend.token_to_kv_pool
    page_size = pool.page_size
    prefix_lens, extend_lens = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    seq_lens = [int(p) + int(e) for p, e in zip(prefix_lens, extend_lens)]
    reservation = reserved_buffers()
    # The CP group the reservation was made for: its exchange group under CP (made at start-up), else this rank alone.
    group = exchange_group() if reservation.cp_size > 1 else SingleRankGroup()
    plan = build_plan(
        pool_page_table(backend.req_to_token, forward_batch.req_pool_indices, seq_lens, page_size),
        prefix_lens,
        extend_lens,
        # Upstream cuts it to the real tokens under CP; an un-split batch may carry MLP-sync padding.
        forward_batch.out_cache_loc[: sum(extend_lens)],
        capacity=page_id_capacity(pool),
        page_size=page_size,
        cp_size=group.cp_size,
        cp_rank=group.cp_rank,
        strategy="interleave" if split else "none",
    )
    if split:
        metadata = forward_batch.attn_cp_metadata
        check_split_matches_upstream(plan, metadata.per_rank_logical_token, metadata.per_rank_actual_token)
    reservation.check_batch(plan.needed_slots * page_size, plan.num_slots, plan.num_tokens, plan.entries)
    batch = backend_state(backend).begin(backend, forward_batch, plan, group, reservation)
    return remap_page_table(batch, page_table, bs_idx)


def remap_page_table(batch: ExtendBatch, page_table: torch.Tensor, bs_idx: torch.Tensor | None) -> torch.Tensor:
    """Token locations of each row's request -> dense locations (row ``i`` is request ``bs_idx[i]``)."""
    rows = page_table.shape[0]
    if bs_idx is None:
        row_req = torch.arange(rows, dtype=torch.int64, device=page_table.device)
    else:
        row_req = bs_idx.to(device=page_table.device, dtype=torch.int64)
    return batch.pipeline.remap(page_table, row_req).to(page_table.dtype)


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


def index_k_pages_as_rows(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """An index-K page buffer ``[pages, page_bytes]`` seen as ``[pages * page_size, page_bytes / page_size]``
    rows (the shape upstream's store and read take; only whole pages are ever copied through it)."""
    return buffer.view(buffer.shape[0] * page_size, buffer.shape[1] // page_size)


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
    batch = _indexer_batch(forward_batch)
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
    batch = _indexer_batch(forward_batch)
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
    batch = _indexer_batch(forward_batch)
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


def page_table_capacity(backend: Any, forward_batch: Any, pool_capacity: int) -> int:
    """The rows ``page_table_1_flattened`` indexes: the dense view's under the mode (its tables hold dense
    locations), the pool's (``pool_capacity``) otherwise."""
    batch = extend_batch(backend, forward_batch)
    return pool_capacity if batch is None else batch.plan.dense_rows


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
