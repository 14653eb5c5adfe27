"""One DSA attention backend's CP shared-KV batch: the state the mode keeps on it from one plan hook to the next.

Used by the DSA hooks (:mod:`.dsa_metadata` begins a batch, :mod:`.dsa_latent` and :mod:`.dsa_index_k` find it): a
backend's :class:`BackendState` (``backend.cp_shared_kv``; the target's and each draft's) holds the dense buffers it
reuses across batches (sized by the start-up reservation), the batch in flight (:class:`ExtendBatch`: its plan and
:class:`~sglang_cpkv.runtime.LayerPipeline`) and earlier batches' error counters on their way to the host (read
without a sync once their copy has landed; the error names its batch). No module global holds a batch: the indexer
finds its backend as upstream's does (``get_attn_backend()``). With the flag on, an extend forward the plan hook did
not begin is refused (:func:`extend_batch`). Design: ``docs/design/cp-shared-kv.md`` sections 3-4.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from sglang_cpkv.hooks.cache_write import owned_pool_write_locs
from sglang_cpkv.hooks.hicache import after_layer_load
from sglang_cpkv.hooks.settings import FLAG, enabled
from sglang_cpkv.ops.errors import CpSharedKvError, describe_errors
from sglang_cpkv.runtime import CpGroup, CpSharedKvPlan, LayerPipeline, PagedKind, as_pages
from sglang_cpkv.runtime.plan import PlanStaging
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

    def row_numbers(self, name: str, rows: int, device: torch.device) -> torch.Tensor:
        """int64 ``0..rows-1`` on ``device`` under ``name``, made once (a batch slices the locations it needs)."""
        key = (name, rows, torch.device(device))
        if key not in self._held:
            self._held[key] = [torch.arange(rows, dtype=torch.int64, device=device)]
        return self._held[key][0]

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
    """A batch's device error counter on its way to the host, without a synchronization, into ``host`` (a pinned
    buffer of the counter's shape, reused once the counter has been read)."""

    def __init__(self, batch: ExtendBatch, host: torch.Tensor) -> None:
        errors = batch.plan.errors
        self.where = f"CP shared-KV extend batch {batch.number} ({batch.plan.num_requests} requests)"
        self.host = host
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
        self._kinds_made: dict[tuple, list[PagedKind]] = {}
        self._read_counters: list[torch.Tensor] = []  # pinned host counters already read: the next transits' buffers
        self._staging: tuple[tuple, PlanStaging] | None = None  # (reservation, device), its staging

    def plan_staging(self, reservation: Reservation, device: torch.device) -> PlanStaging:
        """The pinned buffer every batch's plan stages through, made once at the size the reservation gives it."""
        key = (reservation, torch.device(device))
        if self._staging is None or self._staging[0] != key:  # first use (or another reservation: tests)
            self._staging = (key, PlanStaging(reservation.plan_staging_bytes, device, reservation.plan_staging_refusal))
        return self._staging[1]

    def surface_errors(self) -> None:
        """Raise, once, for the earlier batches whose counters have reached the host and show dropped ids; the
        counters still in transit stay for a later batch. A batch's error is raised by one later batch only."""
        landed = [errors.landed() for errors in self._in_transit]
        arrived = [errors for errors, done in zip(self._in_transit, landed) if done]
        self._in_transit = [errors for errors, done in zip(self._in_transit, landed) if not done]
        messages = [m for m in (describe_errors(errors.host, errors.where) for errors in arrived) if m]
        self._read_counters.extend(errors.host for errors in arrived)
        if messages:
            raise CpSharedKvError("; ".join(messages))

    def begin(
        self, backend: Any, forward_batch: Any, plan: CpSharedKvPlan, group: CpGroup, reservation: Reservation
    ) -> ExtendBatch:
        """End the previous batch (its counter goes to the host) and begin this one in the reserved buffers."""
        if self.batch is not None:
            errors = self.batch.plan.errors
            if self._read_counters:  # every counter of a backend has one shape and device
                host = self._read_counters.pop()
            else:
                host = torch.empty(errors.shape, dtype=errors.dtype, pin_memory=errors.is_cuda)
            self._in_transit.append(_ErrorsInTransit(self.batch, host))
            self.batch = None
        self.surface_errors()
        pool = backend.token_to_kv_pool
        latent = reads_dense_latent(backend, forward_batch)
        pipeline = LayerPipeline(
            plan,
            group,
            self._kinds(pool, plan, reservation, latent),
            layer_ahead=reservation.layer_ahead,
            stream=_side_stream(plan.device),
        )
        scratch = scratch_locs = None
        if latent:
            first = pool.kv_buffer[0]
            (held,) = self.buffers.get(
                f"{LATENT}/scratch", reservation.chunk_tokens + 1, first[0].numel(), first.dtype, first.device, 1
            )
            scratch = held[: plan.num_tokens + 1].view(-1, *first.shape[1:])
            rows = self.buffers.row_numbers(f"{LATENT}/scratch locations", reservation.chunk_tokens + 1, plan.device)
            scratch_locs = rows[1 : plan.num_tokens + 1]
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

    def _kinds(self, pool: Any, plan: CpSharedKvPlan, reservation: Reservation, latent: bool) -> list[PagedKind]:
        """The kinds a batch materializes (the latent KV when it reads a dense latent view, the index K): the same
        for every batch of the backend under one reservation, so made once."""
        key = (reservation, plan.page_size, latent)
        if key not in self._kinds_made:
            kinds = [self._latent_kind(pool, plan, reservation)] if latent else []
            index_k = self._index_k_kind(pool, plan, reservation)
            if index_k is not None:
                kinds.append(index_k)
            self._kinds_made[key] = kinds
        return self._kinds_made[key]

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
        first, page_size = pool.kv_buffer[0], plan.page_size
        page = first[:page_size]
        views = self._views(LATENT, reservation, page, reservation.latent_token_bytes)
        return PagedKind(
            name=LATENT,
            layers=tuple(range(pool.start_layer, pool.start_layer + pool.layer_num)),
            pool_pages=after_layer_load(
                pool, lambda layer: as_pages(pool.kv_buffer[layer - pool.start_layer], page_size, "KV pool")
            ),
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
            pool_pages=after_layer_load(pool, pool.get_index_k_with_scale_buffer),
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


def indexer_batch(forward_batch: Any) -> ExtendBatch | None:
    """The batch of the backend the indexer runs under, found as upstream's indexer finds it (the forward context)."""
    from sglang.srt.model_executor.forward_context import get_attn_backend

    return extend_batch(get_attn_backend(), forward_batch)
