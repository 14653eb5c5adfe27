"""The per-layer CP shared-KV pipeline: the one place the mode's layer sequence is written.

Per batch a :class:`LayerPipeline` is begun from the batch's :class:`~.plan.CpSharedKvPlan` (by the DSA hooks, and by
every test of the mode); then, per layer and kind of paged KV (:class:`PagedKind`: latent KV, DSA index K), in this
order: 1. **history** (:meth:`LayerPipeline.dense_pages`: a copy at cp 1; under CP each rank packs its owned history
pages into its block of the region and one in-place all-gather fills the rest; with ``layer_ahead`` a layer ahead on
a side stream), 2. **current** (:meth:`LayerPipeline.dense_view`: CURRENT_REUSE), 3. **remap**
(:meth:`LayerPipeline.remap`: top-k pool locations -> dense), 4. **persist** (:meth:`LayerPipeline.persist_owned`:
owned current rows into the pool, only after step 1 of the same layer and kind). Every rank takes the same kinds'
layers in the same order (under CP each history is a collective). Design: ``docs/design/cp-shared-kv.md`` section 4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

import sglang_cpkv.runtime.checked as checked_mode
from sglang_cpkv import ops
from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime.group import CpGroup
from sglang_cpkv.runtime.plan import CpSharedKvPlan


def as_pages(rows: torch.Tensor, page_size: int, what: str) -> torch.Tensor:
    """``[pages * page_size, row...]`` -> ``[pages, page_size * row_elems]`` (a view)."""
    if rows.shape[0] % page_size:
        raise CpSharedKvError(f"{what} has {rows.shape[0]} rows, not a multiple of page_size={page_size}")
    if not rows.is_contiguous():
        raise CpSharedKvError(f"{what} must be contiguous to be viewed as pages")
    return rows.view(rows.shape[0] // page_size, -1)


@dataclass(frozen=True)
class PagedKind:
    """One kind of paged KV the mode materializes per layer.

    Attributes:
        name: how errors and callers name it (``"latent"``, ``"index_k"``, ...).
        layers: the layers that have this kind, in forward order (an IndexShare layer that reuses
            another layer's top-k has no index-K pool and is not listed for index K).
        pool_pages: layer -> this rank's pool of that layer as pages ``[plan.pool_pages, page_elems]``.
        buffers: dense page buffers ``[>= num_slots, page_elems]``: two with layer-ahead, else one.
        row_shape, row_dtype: a token row (``page_elems = page_size * prod(row_shape)``) when the page
            is ``page_size`` rows of one token each (latent KV); ``None`` when the page has its own
            layout (index-K pages: keys then scales) and only whole pages are copied - the caller then
            writes current tokens with its own writer at :meth:`LayerPipeline.current_write_locs`.
    """

    name: str
    layers: tuple[int, ...]
    pool_pages: Callable[[int], torch.Tensor]
    buffers: tuple[torch.Tensor, ...]
    row_shape: tuple[int, ...] | None = None
    row_dtype: torch.dtype | None = None

    def buffer_pages(self, need: int) -> int:
        """The pages of the smallest of the first ``need`` dense buffers, after checking them (once per kind and
        ``need``: a kind serves every batch of its backend): ``need`` of them, one page shape, dtype and device, two
        distinct tensors for the layer-ahead history."""
        if need not in self._buffer_pages:
            if len(self.buffers) < need:
                history = "layer-ahead" if need == 2 else "synchronous"
                raise CpSharedKvError(f"{self.name}: {history} history needs {need} dense buffers")
            buffers = self.buffers[:need]
            if len({(tuple(b.shape[1:]), b.dtype, b.device) for b in buffers}) != 1:
                raise CpSharedKvError(f"{self.name}: dense buffers of different page shapes, dtypes or devices")
            if need == 2 and buffers[0].data_ptr() == buffers[1].data_ptr():
                raise CpSharedKvError(f"{self.name}: the two layer-ahead buffers are one tensor")
            self._buffer_pages[need] = min(b.shape[0] for b in buffers)
        return self._buffer_pages[need]

    @cached_property
    def _buffer_pages(self) -> dict[int, int]:
        return {}

    @cached_property
    def layer_positions(self) -> dict[int, int]:
        """Each layer's index in :attr:`layers`, made once per kind (a kind serves every batch of its backend)."""
        position = {layer: i for i, layer in enumerate(self.layers)}
        if len(position) != len(self.layers):
            raise CpSharedKvError(f"{self.name}: a layer is listed twice in {self.layers}")
        return position


def rows_kind(
    name: str,
    pools: Sequence[torch.Tensor],
    plan: CpSharedKvPlan,
    *,
    layer_ahead: bool,
    fill_byte: int | None = None,
) -> PagedKind:
    """A token-row kind over this rank's per-layer pools ``pools[l] = [plan.pool_pages * page_size, row...]``
    (layers ``0..L-1``),
    with fresh dense buffers sized for ``plan`` (bytes set to ``fill_byte`` when given, so unwritten
    rows are recognizable in tests)."""
    if not pools:
        raise CpSharedKvError(f"{name}: no pools")
    first = pools[0]
    pages = [as_pages(pool, plan.page_size, f"{name} pool of layer {layer}") for layer, pool in enumerate(pools)]
    buffers = []
    for _ in range(2 if layer_ahead else 1):
        buffer = torch.empty((plan.num_slots, pages[0].shape[1]), dtype=first.dtype, device=first.device)
        if fill_byte is not None:
            buffer.view(torch.uint8).fill_(fill_byte)
        buffers.append(buffer)
    return PagedKind(
        name=name,
        layers=tuple(range(len(pools))),
        pool_pages=pages.__getitem__,
        buffers=tuple(buffers),
        row_shape=tuple(first.shape[1:]),
        row_dtype=first.dtype,
    )


class _KindState:
    """Per kind: which layers' histories are started, taken, and the events that order them."""

    def __init__(self, kind: PagedKind, plan: CpSharedKvPlan, layer_ahead: bool) -> None:
        need = 2 if layer_ahead else 1
        pages = kind.buffer_pages(need)
        if pages < plan.num_slots:
            raise CpSharedKvError(
                f"{kind.name}: dense buffer of {pages} pages, the batch needs {plan.num_slots} dense slots"
            )
        self.kind = kind
        self.buffers = tuple(b[: plan.num_slots] for b in kind.buffers[:need])
        self.position = kind.layer_positions
        self.started: dict[int, torch.cuda.Event | None] = {}
        self.taken: set[int] = set()

    def buffer(self, layer: int) -> torch.Tensor:
        return self.buffers[self.position[layer] % len(self.buffers)]

    def next_layer(self, layer: int) -> int | None:
        i = self.position[layer] + 1
        return self.kind.layers[i] if i < len(self.kind.layers) else None


class LayerPipeline:
    """One batch's per-layer CP shared-KV work (the module docstring's sequence).

    Args:
        plan: the batch plan (the same for every layer).
        group: the CP group of the history exchange (``cp_size`` and rank must match the plan).
        kinds: the kinds of paged KV the batch's layers materialize.
        layer_ahead: materialize each kind's next layer while this one computes (two buffers per kind).
        stream: the side CUDA stream for layer-ahead work (default: a new one on a GPU). Pipelines whose
            collectives share one communicator must share one stream, so that their all-gathers run in
            the order they were started on every rank.
    """

    def __init__(
        self,
        plan: CpSharedKvPlan,
        group: CpGroup,
        kinds: Sequence[PagedKind],
        *,
        layer_ahead: bool,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        if group.cp_size != plan.cp_size or group.cp_rank != plan.cp_rank:
            raise CpSharedKvError(
                f"group (cp_size {group.cp_size}, rank {group.cp_rank}) does not match the plan "
                f"(cp_size {plan.cp_size}, rank {plan.cp_rank})"
            )
        self.plan = plan
        self.group = group
        self.layer_ahead = layer_ahead
        self._kinds: dict[str, _KindState] = {}
        for kind in kinds:
            if kind.name in self._kinds:
                raise CpSharedKvError(f"two kinds named {kind.name!r}")
            self._kinds[kind.name] = _KindState(kind, plan, layer_ahead)
        on_cuda = any(state.buffers[0].is_cuda for state in self._kinds.values())
        if layer_ahead and on_cuda:
            device = next(iter(self._kinds.values())).buffers[0].device
            self._stream = stream if stream is not None else torch.cuda.Stream(device=device)
        else:
            self._stream = None

    # -- step 1: history ------------------------------------------------------------------------------

    def _state(self, kind: str, layer: int) -> _KindState:
        state = self._kinds.get(kind)
        if state is None:
            raise CpSharedKvError(f"no kind {kind!r} in this batch's pipeline (kinds: {sorted(self._kinds)})")
        if layer not in state.position:
            raise CpSharedKvError(f"layer {layer} has no {kind} (its layers: {state.kind.layers})")
        return state

    def _materialize(self, state: _KindState, layer: int, dense: torch.Tensor) -> None:
        """History of ``layer`` into ``dense``: the region and the own slots' history rows (a collective under CP
        when the batch has history)."""
        plan = self.plan
        self._fill_region(state, layer, dense)
        if plan.view_copy_dst_slots.numel():
            ops.copy_pages(dense, plan.view_copy_src_slots, dense, plan.view_copy_dst_slots, plan.errors)
        if plan.checked:
            checked_mode.check_errors(plan, f"{state.kind.name} history of layer {layer}")

    def _fill_region(self, state: _KindState, layer: int, dense: torch.Tensor) -> None:
        """This rank's pool pages into the view (at cp 1 the whole history; under CP its block of the region), then
        under CP the all-gather of every rank's block, in place."""
        plan = self.plan
        pool = state.kind.pool_pages(layer)
        self._check_pool(state, pool, layer)
        ops.copy_pages(pool, plan.pool_copy_pages, dense, plan.pool_copy_slots, plan.errors)
        if plan.gather_blocks:
            self.group.all_gather_blocks(dense, plan.gather_blocks)

    def _start(self, state: _KindState, layer: int) -> None:
        dense = state.buffer(layer)
        if self._stream is None:
            self._materialize(state, layer, dense)
            state.started[layer] = None
            return
        # The side stream must not overwrite the buffer before earlier reads on the current stream.
        self._stream.wait_stream(torch.cuda.current_stream(dense.device))
        with torch.cuda.stream(self._stream):
            self._materialize(state, layer, dense)
            event = torch.cuda.Event()
            event.record(self._stream)
        dense.record_stream(self._stream)
        state.started[layer] = event

    def dense_pages(self, kind: str, layer: int) -> torch.Tensor:
        """The dense pages ``[num_slots, page_elems]`` of ``kind`` holding ``layer``'s history.

        The first call for a layer takes its history (layer-ahead: waits for the prefetch, starting it
        when it is the kind's first layer of the batch, then starts the kind's next layer; otherwise
        materializes it now); later calls return the same buffer. A collective under CP.
        """
        state = self._state(kind, layer)
        if layer not in state.taken:
            if not self.layer_ahead:
                self._materialize(state, layer, state.buffer(layer))
            else:
                if layer not in state.started:
                    self._start(state, layer)
                event = state.started.pop(layer)
                if event is not None:
                    torch.cuda.current_stream(state.buffer(layer).device).wait_event(event)
                following = state.next_layer(layer)
                if following is not None:
                    self._start(state, following)
            state.taken = {layer}  # the buffer of an earlier layer is being reused
        return state.buffer(layer)

    # -- step 2: current rows --------------------------------------------------------------------------

    def dense_view(self, kind: str, layer: int, current_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``kind``'s dense view of ``layer`` as token rows ``[num_slots * page_size, row...]``: history,
        then (when given) the all-gathered current rows ``[N, row...]`` (token order, pool row format).

        Synchronous history and current rows run as one ``ops.materialize_and_fill``.
        """
        state = self._state(kind, layer)
        if state.kind.row_shape is None:
            raise CpSharedKvError(f"{kind} pages are not token rows; write current tokens at current_write_locs()")
        # One op for the history's last copy and the current rows (synchronous history).
        fuse = current_rows is not None and not self.layer_ahead and layer not in state.taken
        if fuse:
            dense = state.buffer(layer)
            self._check_current(state, current_rows)
            self._materialize_and_fill(state, layer, dense, current_rows)
            state.taken = {layer}
        else:
            dense = self.dense_pages(kind, layer)
            if current_rows is not None:
                self._check_current(state, current_rows)
                ops.scatter_rows(
                    current_rows.flatten(1), self.plan.current_dense_locs, self._rows(dense), self.plan.errors
                )
                if self.plan.checked:
                    checked_mode.check_errors(self.plan, f"{kind} current rows of layer {layer}")
        return self._rows(dense).view(-1, *state.kind.row_shape)

    def _materialize_and_fill(self, state: _KindState, layer: int, dense: torch.Tensor, rows: torch.Tensor) -> None:
        plan = self.plan
        if plan.cp_size == 1:  # the pool copy is the whole history
            pool = state.kind.pool_pages(layer)
            self._check_pool(state, pool, layer)
            src, src_pages, slots = pool, plan.pool_copy_pages, plan.pool_copy_slots
        else:
            self._fill_region(state, layer, dense)
            src, src_pages, slots = dense, plan.view_copy_src_slots, plan.view_copy_dst_slots
        ops.materialize_and_fill(src, src_pages, dense, slots, rows.flatten(1), plan.current_dense_locs, plan.errors)
        if plan.checked:
            checked_mode.check_errors(plan, f"{state.kind.name} history and current rows of layer {layer}")

    def current_write_locs(self, kind: str, layer: int) -> torch.Tensor:
        """Dense locations ``[N]`` (int64, token order) where a caller writes ``layer``'s current tokens
        into :meth:`dense_pages` with its own writer (kinds whose pages are not token rows)."""
        self._require_history(kind, layer, "current tokens")
        return self.plan.current_dense_locs

    # -- step 3: remap ---------------------------------------------------------------------------------

    def remap(self, locs: torch.Tensor, req_id: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dense locations of top-k pool locations ``[rows, K]`` (or ``[rows]``); ``req_id`` int64 ``[rows]``
        is each row's request (``plan.local_req_id`` for this rank's query rows; -1 padding rows).
        Returns int32 of the shape of ``locs`` (-1: padding, or a page not in the row's request), in ``out`` when given
        (``locs`` itself: in place; ``ops.remap_locs``)."""
        plan = self.plan
        if req_id.shape != locs.shape[:1]:
            raise CpSharedKvError(
                f"remap: req_id {tuple(req_id.shape)} must have one id per row of locs {tuple(locs.shape)}"
            )
        dense_locs = ops.remap_locs(locs, req_id, plan.inverse, plan.page_size, plan.errors, out)
        if plan.checked:
            checked_mode.check_remapped(plan, dense_locs, req_id, "remap")
        return dense_locs

    # -- step 4: persist -------------------------------------------------------------------------------

    def owned_write_locs(self, kind: str, layer: int) -> torch.Tensor:
        """Pool locations ``[N]`` (token order; -1 where this rank does not own the page) for a caller that
        persists ``layer``'s current rows with its own writer. Only after the layer's history was taken."""
        self._require_history(kind, layer, "owned rows")
        return self.plan.owned_cache_write_locs

    def persist_owned(self, kind: str, layer: int, current_rows: torch.Tensor) -> None:
        """The current rows ``[N, row...]`` of pages this rank owns into its pool of ``layer``."""
        state = self._state(kind, layer)
        self._check_current(state, current_rows)
        locs = self.owned_write_locs(kind, layer)
        pool = state.kind.pool_pages(layer)
        ops.scatter_rows(current_rows.flatten(1), locs, self._rows(pool), self.plan.errors)
        if self.plan.checked:
            checked_mode.check_errors(self.plan, f"{kind} owned rows of layer {layer}")

    # -- the current chunk across CP ranks -------------------------------------------------------------

    def gather_current(self, local_rows: torch.Tensor) -> torch.Tensor:
        """All-gather this rank's local current rows ``[physical_rows, row...]`` to token order ``[N, row...]``.

        A collective when the batch is split (every rank calls it); un-split, the local rows are the batch.
        """
        split = self.plan.split
        if local_rows.shape[0] != split.physical_rows:
            raise CpSharedKvError(
                f"local current rows: {local_rows.shape[0]}, the CP split gives this rank {split.physical_rows}"
            )
        if split.strategy == "none":
            return local_rows[: self.plan.num_tokens]
        return split.unshard(self.group.all_gather_rows(local_rows), self.plan.current_gather_index)

    # -- checks ------------------------------------------------------------------------------------------

    def _require_history(self, kind: str, layer: int, what: str) -> None:
        state = self._state(kind, layer)
        if layer not in state.taken:
            raise CpSharedKvError(
                f"layer {layer}: {kind} {what} asked for before the layer's history was taken "
                "(the dense view is built from the pool before this rank writes to it)"
            )

    def _rows(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.view(pages.shape[0] * self.plan.page_size, -1)

    def _check_pool(self, state: _KindState, pool: torch.Tensor, layer: int) -> None:
        plan = self.plan
        if pool.shape[0] != plan.pool_pages or tuple(pool.shape[1:]) != tuple(state.buffers[0].shape[1:]):
            raise CpSharedKvError(
                f"{state.kind.name} pool of layer {layer} is {tuple(pool.shape)} pages, expected "
                f"[{plan.pool_pages} (capacity {plan.capacity} / cp {plan.cp_size}), {state.buffers[0].shape[1]}] "
                "like the dense buffers"
            )

    def _check_current(self, state: _KindState, rows: torch.Tensor) -> None:
        if rows.shape[0] != self.plan.num_tokens:
            raise CpSharedKvError(
                f"{state.kind.name}: {rows.shape[0]} current rows, the batch has {self.plan.num_tokens}"
            )
        if tuple(rows.shape[1:]) != state.kind.row_shape or rows.dtype != state.kind.row_dtype:
            raise CpSharedKvError(
                f"{state.kind.name}: current rows {tuple(rows.shape[1:])} {rows.dtype}, the pool's rows are "
                f"{state.kind.row_shape} {state.kind.row_dtype}"
            )
