"""The per-batch CP shared-KV plan: built once per batch, reused by every layer.

:func:`build_plan` turns a batch's page tables, host lengths and current-token pool locations into a frozen
:class:`CpSharedKvPlan` (the dense layout with shared history slots, the per-request inverse, the history copies,
the owned cache rows); :class:`~.pipeline.LayerPipeline` only reads it. Called by ``hooks/dsa_metadata.py`` (serving),
the harness, the demo and the tests. The layout is numpy host work staged to the device in one copy through
:class:`PlanStaging`; page ids are global, a rank's pool holds the pages it owns (:mod:`.ownership`).
Terms: ``docs/design/cp-shared-kv-contract.md``; the layout and its costs: ``docs/design/cp-shared-kv.md`` section 3.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from sglang_cpkv import ops
from sglang_cpkv.envs import envs
from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE, NUM_ERROR_KINDS, CpSharedKvError
from sglang_cpkv.ops.reference import lookup_slots
from sglang_cpkv.runtime.buckets import round_dense_slots
from sglang_cpkv.runtime.cp_split import CpSplit
from sglang_cpkv.runtime.ownership import owner_pool_loc, owner_pool_page, page_owner, pool_pages_per_rank

PADDING_ID = -1
INT32_MAX = (1 << 31) - 1
# The most page-table entries of a batch: every entry's slot fits int32 whatever the sharing (the region's slots and
# the own slots are each at most the entries).
MAX_ENTRIES = (1 << 30) - 1


@dataclass(frozen=True, eq=False)
class CpSharedKvPlan:
    """Everything the layers of one batch reuse. Built by :func:`build_plan`; never mutated.

    Host attributes:
        num_requests: ``R``. capacity: ``C``, the page ids (under CP ``cp_size`` x :attr:`pool_pages`).
        page_size: tokens per page.
        prefix_lens, extend_lens: per request, history and current token counts.
        request_pages: ``n_r`` per request (its page-table entries).
        entry_starts: per request, the index of its first entry (entries are ``(r, j)`` in order).
        entry_slots_host: int64 host ``[sum n_r]``, the dense slot of every entry (module docstring).
        history_region_slots: ``H``, the slots of the history region (distinct pages read as history).
        gather_blocks: under CP, ``(start, count)`` of each rank's block of the history region (empty at cp 1).
        needed_slots: slots the batch's pages fill: the history region and the own slots (the view rounds it up).
        num_slots: slots of the dense view (``H`` + own slots, rounded).
        num_tokens: ``N = sum(extend_lens)``.
        split: the CP split of the current tokens (:class:`~.cp_split.CpSplit`).
        checked: checked mode (:mod:`.checked`), fixed at build.

    Device tensors (all on the device of ``out_cache_loc``):
        slot_pages: int32 ``[num_slots]``, the page id each dense slot holds (-1: a rounding slot).
        inverse: the per-request inverse (``ops.build_page_inverse`` of every entry's slot): a hash table of
            ``ops.inverse_bytes(entries)`` bytes, whatever ``C``.
        current_dense_locs: int64 ``[N]``, dense location of each current token, from its position (an own slot of
            its request; ``out_cache_loc`` is checked against it, ``ERR_CURRENT_LOC_MISMATCH``): made on the device
            by ``ops.current_dense_locs`` from per-request values.
        pool_copy_pages, pool_copy_slots: int32, the pages of this rank's pool copied into the view and their
            slots: at cp 1 every history-region page and every own entry's history page (page id = pool page);
            under CP the pages of this rank's block (at :func:`~.ownership.owner_pool_page`).
        view_copy_src_slots, view_copy_dst_slots: int32, under CP the copies from the gathered region into own
            slots that hold history rows (empty at cp 1).
        out_cache_loc: ``[N]``, the current tokens' pool locations as given.
        owned_cache_write_locs: int64 ``[N]``: the row of this rank's pool of each current token whose page
            it owns (:func:`~.ownership.page_owner`, :func:`~.ownership.owner_pool_loc`), else -1.
        errors: int32 ``[NUM_ERROR_KINDS]`` device error counter shared by every op of the batch.

    Made on first use (the serving path never asks; checked mode, the harness and the tests do):
    :attr:`slot_req`, :attr:`token_req_id`, and this rank's side of the CP split (the
    serving hooks take upstream's own split): :attr:`local_req_id`, :attr:`local_out_cache_loc`,
    :attr:`local_token_index`, :attr:`current_gather_index`.
    """

    num_requests: int
    capacity: int
    page_size: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    request_pages: tuple[int, ...]
    entry_starts: tuple[int, ...]
    entry_slots_host: torch.Tensor
    history_region_slots: int
    gather_blocks: tuple[tuple[int, int], ...]
    needed_slots: int
    num_slots: int
    num_tokens: int
    split: CpSplit
    checked: bool
    slot_pages: torch.Tensor
    inverse: ops.PageInverse
    current_dense_locs: torch.Tensor
    pool_copy_pages: torch.Tensor
    pool_copy_slots: torch.Tensor
    view_copy_src_slots: torch.Tensor
    view_copy_dst_slots: torch.Tensor
    out_cache_loc: torch.Tensor
    owned_cache_write_locs: torch.Tensor
    errors: torch.Tensor

    @cached_property
    def slot_req(self) -> torch.Tensor:
        """int64 ``[num_slots]``: the request an own slot belongs to (-1: a history-region slot, which no request
        writes, or a rounding slot); no op reads it, so it is not staged."""
        slots = self.entry_slots_host
        requests = torch.arange(self.num_requests, dtype=torch.int64).repeat_interleave(
            torch.tensor(self.request_pages)
        )
        own = slots >= self.history_region_slots
        slot_req = torch.full((self.num_slots,), PADDING_ID, dtype=torch.int64)
        slot_req[slots[own]] = requests[own]
        return _on_device(slot_req, self.device)

    @cached_property
    def token_req_id(self) -> torch.Tensor:
        """int64 ``[N]``: the request row of each current token (token order)."""
        requests = torch.arange(self.num_requests, dtype=torch.int64)
        return _on_device(requests.repeat_interleave(torch.tensor(self.extend_lens)), self.device)

    @cached_property
    def local_token_index(self) -> torch.Tensor:
        """int64 ``[per_rank_logical[cp_rank]]``: the global token of each real local row of this rank."""
        return _on_device(self.split.local_token_index, self.device)

    @cached_property
    def current_gather_index(self) -> torch.Tensor:
        """int64 ``[N]``: see :meth:`~.cp_split.CpSplit.unshard`."""
        return _on_device(self.split.gather_index, self.device)

    @cached_property
    def local_req_id(self) -> torch.Tensor:
        """int64 ``[physical_rows]``: the request row of each local query row of this rank (padding rows -1)."""
        return self.split.shard(self.token_req_id, PADDING_ID, self.local_token_index)

    @cached_property
    def local_out_cache_loc(self) -> torch.Tensor:
        """``[physical_rows]`` (dtype of ``out_cache_loc``): this rank's rows of ``out_cache_loc`` (padding rows -1)."""
        return self.split.shard(self.out_cache_loc, PADDING_ID, self.local_token_index)

    @property
    def cp_size(self) -> int:
        return self.split.cp_size

    @property
    def cp_rank(self) -> int:
        return self.split.cp_rank

    @property
    def pool_pages(self) -> int:
        """Pages of each rank's pool: ``C / cp_size`` (:mod:`.ownership`)."""
        return pool_pages_per_rank(self.capacity, self.cp_size)

    @property
    def device(self) -> torch.device:
        return self.inverse.device

    @property
    def device_bytes(self) -> int:
        """Bytes of every device tensor the plan holds for its batch, the inverse included (the reservation's
        batch-plan part charges them, with the staged entries)."""
        held = self.inverse.nbytes
        for name, value in vars(self).items():  # the fields, and the split's tensors once made
            if isinstance(value, torch.Tensor) and name not in (
                "entry_slots_host",
                "out_cache_loc",
            ):
                held += value.numel() * value.element_size()
        return held

    @property
    def dense_rows(self) -> int:
        """Rows of the dense view: ``num_slots * page_size``."""
        return self.num_slots * self.page_size

    @property
    def entries(self) -> int:
        """Entries of the batch's page tables: ``sum(n_r)`` (the dense rows a per-request layout would need)."""
        return sum(self.request_pages)

    def _tokens(self, request: int) -> int:
        """``request``'s tokens (history and current), after checking it is a request of the batch: a lookup
        outside the batch, or past a request's tokens, would answer with another request's view."""
        if not 0 <= request < self.num_requests:
            raise CpSharedKvError(f"request {request} is not in the batch (requests 0..{self.num_requests - 1})")
        return self.prefix_lens[request] + self.extend_lens[request]

    def request_slots(self, request: int) -> torch.Tensor:
        """int64 host ``[n_r]``: the dense slot of each of ``request``'s pages, in page-index order (its view)."""
        self._tokens(request)
        start = self.entry_starts[request]
        return self.entry_slots_host[start : start + self.request_pages[request]]

    def request_locations(self, request: int, end: int | None = None) -> torch.Tensor:
        """int64 host ``[end]``: the dense location of each logical position ``[0, end)`` of ``request`` (default
        ``end``: its history and current tokens), i.e. its view in position order."""
        tokens = self._tokens(request)
        end = tokens if end is None else end
        if not 0 <= end <= tokens:
            raise CpSharedKvError(f"request {request} has {tokens} tokens, asked for the locations of {end}")
        positions = torch.arange(end, dtype=torch.int64)
        return self.request_slots(request)[positions // self.page_size] * self.page_size + positions % self.page_size

    def dense_location(self, request: int, position: int) -> int:
        """The dense location of logical position ``position`` of ``request`` (host arithmetic)."""
        tokens = self._tokens(request)
        if not 0 <= position < tokens:
            raise CpSharedKvError(f"position {position} is outside request {request}'s {tokens} tokens")
        slot = int(self.entry_slots_host[self.entry_starts[request] + position // self.page_size])
        return slot * self.page_size + position % self.page_size

    def raise_if_errors(self, where: str = "CP shared-KV batch") -> None:
        """Synchronize and raise :class:`CpSharedKvError` if any op of the batch dropped a bad id."""
        ops.raise_if_errors(self.errors, where)


class PlanStaging:
    """The pinned host buffer every batch's plan stages through (:func:`build_plan`): sized once, at start-up, for
    the largest batch the reservation admits (:func:`staging_bytes`); a batch that needs more is refused. Before a
    batch writes it, the previous batch's copy out of it has finished: its event is queried (on the serving path it
    has, since the copy runs ahead of that batch's layers), and waited on only when it has not."""

    def __init__(self, nbytes: int, device: torch.device | str, refusal: str = "") -> None:
        """``device``: the plan's (``"cuda"`` is the current CUDA device, as a tensor made there says).
        ``refusal``: what to tell the operator when a batch does not fit (the setting that sizes the buffer)."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.refusal = refusal
        self._copied: torch.cuda.Event | None = None

    def stage(self, layout: _BatchLayout, num_slots: int):
        """The layout's staging on the device as int64 and int32 tensors (:meth:`_BatchLayout.stage_sizes`'s
        order), with one copy and no host sync."""
        sizes64, sizes32 = layout.stage_sizes(num_slots, NUM_ERROR_KINDS)
        split = 8 * sum(sizes64)
        nbytes = split + 4 * sum(sizes32)
        if nbytes > self.buffer.numel():
            raise CpSharedKvError(
                f"the batch's plan stages {nbytes} bytes, more than the {self.buffer.numel()} reserved at start-up"
                + (f": {self.refusal}" if self.refusal else "")
            )
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the stream has not reached the previous batch's copy yet
        host = self.buffer[:nbytes]
        layout.fill(host, num_slots, NUM_ERROR_KINDS)
        if self.device.type == "cuda":
            staged = host.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            staged = host.to(self.device, copy=True)  # the plan's tensors must outlive the next batch's staging
        return (
            list(torch.split_with_sizes(staged[:split].view(torch.int64), sizes64)),
            list(torch.split_with_sizes(staged[split:].view(torch.int32), sizes32)),
        )


def staging_bytes(entries: int, slots: int) -> int:
    """The most bytes one batch of at most ``entries`` page-table entries and ``slots`` dense slots stages
    (:meth:`_BatchLayout.stage_sizes`): int64 per entry its request and, for ids not on the host, its table cell, per
    request (at most one per entry) two offsets; int32 the error counter, per entry its slot, its page, and at most
    two copy pairs (pool and view), per slot its page."""
    return 8 * (2 * entries + 2 * entries) + 4 * (NUM_ERROR_KINDS + 6 * entries + slots)


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync (through pinned memory on a GPU)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _host_page_table(page_table: torch.Tensor | Sequence[Sequence[int]], num_requests: int) -> torch.Tensor:
    if isinstance(page_table, torch.Tensor):
        if page_table.dim() != 2:
            raise CpSharedKvError(f"page_table must be 2-D [R, pages], got shape {tuple(page_table.shape)}")
        if page_table.dtype.is_floating_point or page_table.dtype == torch.bool:
            raise CpSharedKvError(f"page_table must hold integer page ids, got dtype {page_table.dtype}")
        table = page_table
    else:
        rows = [list(map(int, row)) for row in page_table]
        width = max((len(row) for row in rows), default=0)
        table = torch.full((len(rows), width), PADDING_ID, dtype=torch.int64)
        for r, row in enumerate(rows):
            table[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
    if table.shape[0] != num_requests:
        raise CpSharedKvError(f"page_table has {table.shape[0]} rows but the batch has {num_requests} requests")
    return table


def _validate_lengths(
    prefix_lens: Sequence[int], extend_lens: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The host lengths as tuples of ints, after checking them. Plain Python: a batch's few dozen lengths, on a host
    path that runs cold between upstream's own per-batch work, where each numpy call costs more than these loops."""
    try:
        prefix, extend = tuple(map(operator.index, prefix_lens)), tuple(map(operator.index, extend_lens))
    except TypeError as e:
        raise CpSharedKvError(f"prefix_lens and extend_lens must hold integer token counts: {e}") from None
    if len(prefix) != len(extend):
        raise CpSharedKvError(f"prefix_lens has {len(prefix)} entries, extend_lens {len(extend)}")
    if not prefix:
        raise CpSharedKvError("empty batch: no requests")
    for name, lens in (("prefix_lens", prefix), ("extend_lens", extend)):
        if min(lens) < 0:
            bad = [(r, n) for r, n in enumerate(lens) if n < 0]
            raise CpSharedKvError(f"{name} must be >= 0: (request, length) {bad}")
    return prefix, extend


def _validate_host_locations(out_cache_loc: torch.Tensor, capacity: int, page_size: int) -> None:
    """Current-token locations inside the pool (host tensor only)."""
    lo, hi = int(out_cache_loc.min()), int(out_cache_loc.max())
    if lo < 0 or hi >= capacity * page_size:
        raise CpSharedKvError(
            f"out_cache_loc values span [{lo}, {hi}], outside the pool [0, capacity*page_size={capacity * page_size})"
        )


def _validate_host_ids(ids: np.ndarray, entry_req: np.ndarray, entry_j: np.ndarray, capacity: int) -> None:
    """Page ids ``ids`` of the entries in ``[0, C)`` and distinct within each request (host table only); the first
    request (in batch order) with a bad id or a repeated one is named."""
    outside = (ids < 0) | (ids >= capacity)
    order = np.lexsort((ids, entry_req))  # by request, then page id: a repeat is next to its first
    repeat = np.zeros(ids.size, dtype=bool)
    repeat[order[1:]] = (entry_req[order[1:]] == entry_req[order[:-1]]) & (ids[order[1:]] == ids[order[:-1]])
    bad = outside | repeat
    if not bad.any():
        return
    r = int(entry_req[np.flatnonzero(bad)[0]])
    mine = entry_req == r
    if outside[mine].any():
        raise CpSharedKvError(
            f"request {r}: page ids outside [0, capacity={capacity}) at page index/value "
            f"{[(int(j), int(p)) for j, p in zip(entry_j[mine & outside], ids[mine & outside])]}"
        )
    raise CpSharedKvError(
        f"request {r}: page ids {sorted(set(ids[mine & repeat].tolist()))} appear twice in its page table"
    )


def _in_range_or_capacity(ids, capacity: int):
    """Page ids (numpy or torch int64) with every id outside ``[0, C)`` replaced by ``C`` before any int32 cast (so
    ``2**32 + 5`` cannot wrap to page 5): the inverse build counts ``C`` as a bad id, the layout never shares it."""
    where = np.where if isinstance(ids, np.ndarray) else torch.where
    return where((ids >= 0) & (ids < capacity), ids, capacity)


def _entry_pages(table: torch.Tensor, flat_entries: torch.Tensor, capacity: int) -> torch.Tensor:
    """int32 page id of every entry, gathered on the table's device (``flat_entries``: ``r * W + j`` of the
    ``[R, W]`` table)."""
    pages = table.reshape(-1).index_select(0, flat_entries)
    return _in_range_or_capacity(pages, capacity).to(torch.int32)


@dataclass(frozen=True)
class _Layout:
    """The dense layout of a batch (host int64 numpy; module docstring)."""

    entry_slots: np.ndarray  # [E] the slot of every entry
    own_entries: np.ndarray  # [O] the entries with a slot of their own, in slot order (slots H .. H + O - 1)
    region_pages: np.ndarray  # [H] the page id of every history-region slot
    gather_blocks: tuple[tuple[int, int], ...]  # under CP (start, count) of each rank's block; () at cp 1
    own_history_pages: np.ndarray  # [M] page ids of the own entries that hold history rows (copied into their slot)
    own_history_slots: np.ndarray  # [M] their own slots
    own_history_sources: np.ndarray  # [M] under CP the region slot of each of those pages (at cp 1 -1: pool copies)


def _dense_layout(
    pages: np.ndarray,
    entry_req: np.ndarray,
    entry_j: np.ndarray,
    prefix: np.ndarray,
    extend: np.ndarray,
    *,
    page_size: int,
    cp_size: int,
    capacity: int,
) -> _Layout:
    """Shared history slots for entries read only as history, own slots for every other entry (module docstring).

    ``pages``: int64 ``[E]`` page ids of the entries (``C`` for a bad id: never shared, never fetched). Sets of
    pages are flags over the page ids (``C + 1``: the last is the bad-id bucket), not sorts of the entries: every
    step is linear in the entries and the page ids, in numpy (a few microseconds a step where torch's host ops take
    tens)."""
    # Per request: its entries from page index prefix // page_size on take current tokens (none without current
    # tokens); those below ceil(prefix / page_size) hold history rows.
    first_writing = np.where(extend > 0, prefix // page_size, np.iinfo(np.int64).max)
    writes = entry_j >= first_writing[entry_req]  # takes current tokens
    has_history = entry_j < (-(-prefix // page_size))[entry_req]
    fetchable = pages < capacity
    written = np.zeros(capacity + 1, dtype=bool)
    written[pages[writes]] = True  # the page takes current tokens of some request
    shared = ~writes & fetchable & ~written[pages]  # history only (a zero-extend request's partial page included)

    # The region: every distinct page some view reads from it, ordered by (owner rank, page id): under CP each rank's
    # block is contiguous (at cp 1 every owner is 0, so it is page-id order). At cp 1 an own slot's history comes
    # straight from the pool, so the region holds the shared entries' pages only; under CP it comes from the gathered
    # region, so the region holds every page read as history.
    in_region = np.zeros(capacity + 1, dtype=bool)
    in_region[pages[shared if cp_size == 1 else has_history]] = True
    region = np.flatnonzero(in_region[:capacity])
    blocks: tuple[tuple[int, int], ...] = ()
    if cp_size > 1 and region.size:
        owner = page_owner(region, cp_size)
        region = region[np.argsort(owner, kind="stable")]
        counts = np.bincount(owner, minlength=cp_size)
        blocks = tuple(zip((np.cumsum(counts) - counts).tolist(), counts.tolist()))
    region_slot = np.empty(capacity + 1, dtype=np.int64)  # read at region pages only
    region_slot[region] = np.arange(region.size)

    own_entries = np.flatnonzero(~shared)
    entry_slots = np.empty_like(pages)
    entry_slots[shared] = region_slot[pages[shared]]
    entry_slots[own_entries] = region.size + np.arange(own_entries.size)
    own_history = ~shared & has_history & fetchable
    own_history_pages = pages[own_history]
    sources = region_slot[own_history_pages] if cp_size > 1 else np.full(own_history_pages.size, PADDING_ID)
    return _Layout(
        entry_slots,
        own_entries,
        region,
        blocks,
        own_history_pages,
        entry_slots[own_history],
        sources,
    )


def _check_page_ids(capacity: int, page_size: int, cp_size: int) -> None:
    if capacity < 1 or page_size < 1:
        raise CpSharedKvError(f"capacity and page_size must be >= 1, got capacity={capacity}, page_size={page_size}")
    if capacity > INT32_MAX:
        raise CpSharedKvError(f"capacity {capacity} page ids do not fit int32")
    if cp_size > 1 and capacity % cp_size:
        raise CpSharedKvError(
            f"capacity {capacity} is not a multiple of cp_size {cp_size}: under CP the page ids number cp_size x "
            "one rank's pool pages (upstream's page-interleave allocator)"
        )


@dataclass(frozen=True)
class _Entries:
    """The batch's page-table entries ``(r, j)``, in that order (host int64)."""

    starts: np.ndarray  # [R] the index of each request's first entry
    req: np.ndarray  # [E] r of every entry
    j: np.ndarray  # [E] j of every entry
    cells: np.ndarray  # [E] r * W + j: every entry's cell of the row-major [R, W] page table

    def page_ids(self, table: torch.Tensor) -> np.ndarray:
        """int64 ``[E]``: the page id of every entry in a host table (a flat gather: a quarter of the host time of
        indexing by ``(r, j)``)."""
        return np.take(table.numpy().reshape(-1), self.cells).astype(np.int64, copy=False)


def _pages_needed(width: int, prefix: Sequence[int], extend: Sequence[int], page_size: int) -> tuple[int, ...]:
    """``n_r``, the entries of each request, after checking that each request's view fits int32 locations, the
    table's ``width`` columns, and the batch's entries :data:`MAX_ENTRIES`."""
    pages_needed = tuple(-(-(p + e) // page_size) for p, e in zip(prefix, extend))
    longest = max(pages_needed)
    if longest * page_size > INT32_MAX:
        raise CpSharedKvError(
            f"a request's dense view needs {longest} slots x page_size {page_size} = {longest * page_size} locations, "
            f"more than int32 holds ({INT32_MAX}): split the batch"
        )
    if longest > width:
        too_long = [(r, n) for r, n in enumerate(pages_needed) if n > width]
        raise CpSharedKvError(f"page_table has {width} columns but (request, pages needed) {too_long} do not fit")
    entries = sum(pages_needed)
    if entries > MAX_ENTRIES:
        raise CpSharedKvError(
            f"the batch's page tables have {entries} entries, more than {MAX_ENTRIES}: split the batch"
        )
    return pages_needed


def _entries(pages_needed: Sequence[int], width: int) -> _Entries:
    """Every entry of the batch (``width``: the page table's columns)."""
    pages_needed = np.asarray(pages_needed, dtype=np.int64)
    starts = np.cumsum(pages_needed) - pages_needed
    req = np.repeat(np.arange(pages_needed.size, dtype=np.int64), pages_needed)
    j = np.arange(req.size, dtype=np.int64) - starts[req]
    return _Entries(starts, req, j, req * width + j)


class _BatchLayout:
    """A batch's dense layout (:func:`_dense_layout`) and what it stages (:class:`PlanStaging`)."""

    def __init__(
        self,
        table: torch.Tensor | None,
        width: int,
        prefix: Sequence[int],
        extend: Sequence[int],
        pages_needed: Sequence[int],
        *,
        page_size: int,
        cp_size: int,
        cp_rank: int,
        capacity: int,
        validate: bool,
    ):
        """``table``: the host page table, or None when its ids are not on the host (a device table, no history:
        every entry its own slot); ``validate``: check the host table's ids. ``prefix``, ``extend``, ``pages_needed``:
        per request (:func:`_validate_lengths`, :func:`_pages_needed`)."""
        prefix, extend = np.asarray(prefix, dtype=np.int64), np.asarray(extend, dtype=np.int64)
        entries = _entries(pages_needed, width)
        if validate:
            _validate_host_ids(entries.page_ids(table), entries.req, entries.j, capacity)
        self.pages_known = table is not None
        if self.pages_known:
            pages = _in_range_or_capacity(entries.page_ids(table), capacity)
        else:
            pages = np.full(entries.req.size, capacity, dtype=np.int64)
        layout = _dense_layout(
            pages, entries.req, entries.j, prefix, extend, page_size=page_size, cp_size=cp_size, capacity=capacity
        )
        self.num_entries = int(entries.req.size)
        self.entry_starts = tuple(entries.starts.tolist())
        self.entry_slots = layout.entry_slots
        self.region_slots = int(layout.region_pages.size)
        self.own_slots = int(layout.own_entries.size)
        self.gather_blocks = layout.gather_blocks
        offsets = _current_token_offsets(layout.entry_slots, entries.starts, prefix, extend, page_size)
        self._int64s = [entries.req, *offsets] + ([] if self.pages_known else [entries.cells])
        self._int32s = [layout.entry_slots, *_history_copies(layout, cp_size, cp_rank)]
        self._pages = pages
        self._slot_pages = np.concatenate([layout.region_pages, pages[layout.own_entries]])

    def stage_sizes(self, num_slots: int, num_errors: int) -> tuple[list[int], list[int]]:
        """Elements of each staged array: int64 ``entry_req [E]``, ``token_ends [R]``,
        ``dense_offsets [R]`` (then the entries' cells ``r * W + j`` when the ids are not on the host); int32 the
        error counter ``[num_errors]``, ``entry_slots [E]``, the pool copies' pages and slots, the view copies' sources
        and destinations (then the entries' page ids and ``slot_pages [num_slots]`` when the ids are on the host)."""
        sizes64 = [a.size for a in self._int64s]
        sizes32 = (
            [num_errors] + [a.size for a in self._int32s] + ([self.num_entries, num_slots] if self.pages_known else [])
        )
        return sizes64, sizes32

    def fill(self, buffer: torch.Tensor, num_slots: int, num_errors: int) -> None:
        """Write the staging into the host byte tensor ``buffer`` (int64 arrays, then int32; ``slot_pages`` rounded
        to ``num_slots`` with -1)."""
        rounding = np.full(num_slots - self.region_slots - self.own_slots, PADDING_ID, dtype=np.int64)
        int64s = self._int64s
        int32s = [np.zeros(num_errors, dtype=np.int32), *self._int32s]
        if self.pages_known:
            int32s += [self._pages, np.concatenate([self._slot_pages, rounding])]
        packed = buffer.numpy()  # the values are written straight into the (pinned) buffer the copy reads
        split = 8 * sum(a.size for a in int64s)
        np.concatenate(int64s, out=packed[:split].view(np.int64), casting="same_kind")
        np.concatenate(int32s, out=packed[split:].view(np.int32), casting="same_kind")


def _check_current_locations(out_cache_loc: torch.Tensor, num_tokens: int, capacity: int, page_size: int) -> None:
    if not isinstance(out_cache_loc, torch.Tensor) or out_cache_loc.dim() != 1:
        raise CpSharedKvError("out_cache_loc must be a 1-D tensor of pool token locations")
    if out_cache_loc.numel() != num_tokens:
        raise CpSharedKvError(f"out_cache_loc has {out_cache_loc.numel()} entries, sum(extend_lens) = {num_tokens}")
    if out_cache_loc.dtype not in (torch.int32, torch.int64):
        raise CpSharedKvError(f"out_cache_loc must be int32 or int64, got {out_cache_loc.dtype}")
    if out_cache_loc.device.type == "cpu":
        _validate_host_locations(out_cache_loc, capacity, page_size)


def _history_copies(layout: _Layout, cp_size: int, cp_rank: int) -> tuple[np.ndarray, ...]:
    """``(pool pages, their slots, view source slots, view destination slots)``: this rank's pool pages into the view,
    then (under CP, after the gather) the copies from the region into own slots."""
    region, empty = layout.region_pages, np.empty(0, dtype=np.int64)
    if cp_size == 1:
        pool_pages = np.concatenate([region, layout.own_history_pages])
        return pool_pages, np.concatenate([np.arange(region.size), layout.own_history_slots]), empty, empty
    start, count = layout.gather_blocks[cp_rank] if layout.gather_blocks else (0, 0)
    pool_pages = owner_pool_page(region[start : start + count], cp_size)
    return pool_pages, np.arange(start, start + count), layout.own_history_sources, layout.own_history_slots


def _current_token_offsets(
    entry_slots: np.ndarray, entry_starts: np.ndarray, prefix: np.ndarray, extend: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(token_ends, dense_offsets)``, int64 ``[R]``, the operands of ``ops.current_dense_locs``: a request's
    current tokens fill its entries from page index ``prefix // page_size`` to its last, all own slots (each takes
    current tokens), numbered in entry order: consecutive slots, so its token ``t`` (batch order) is at dense location
    ``t`` plus one per-request offset (0 for a request without current tokens, which no token reads)."""
    token_ends = np.cumsum(extend)
    writers = np.flatnonzero(extend)
    first = entry_slots[entry_starts[writers] + prefix[writers] // page_size] * page_size + prefix[writers] % page_size
    dense_offsets = np.zeros(extend.size, dtype=np.int64)
    dense_offsets[writers] = first - (token_ends - extend)[writers]
    return token_ends, dense_offsets


def _owned_cache_write_locs(out_cache_loc: torch.Tensor, page_size: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 ``[N]``: the row of this rank's pool of each current token whose page it owns, else -1."""
    locs = out_cache_loc.to(torch.int64)
    if cp_size == 1:
        return locs
    owned = page_owner(torch.div(locs, page_size, rounding_mode="floor"), cp_size) == cp_rank
    return torch.where(owned, owner_pool_loc(locs, page_size, cp_size), PADDING_ID)


def build_plan(
    page_table: torch.Tensor | Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    *,
    capacity: int,
    page_size: int,
    split: CpSplit,
    checked: bool | None = None,
    staging: PlanStaging | None = None,
) -> CpSharedKvPlan:
    """Build the batch plan (once per batch, before the first layer).

    Args:
        page_table: ``[R, W]`` integer page ids (host or device tensor), or ``R`` host lists.
            Row ``r`` lists request ``r``'s pages in page-index order; it must cover its history
            and current tokens (``ceil((prefix+extend)/page_size) <= W``); entries past that are
            ignored.
        prefix_lens: host ``[R]`` history token counts (already in the pool).
        extend_lens: host ``[R]`` current token counts (computed in this forward).
        out_cache_loc: int32/int64 ``[N]`` pool locations of the current tokens, token order
            (request-major); ``N = sum(extend_lens)``. Its device is the plan's device.
        capacity: ``C``, the page ids (under CP a multiple of ``cp_size``: each rank's pool holds
            ``C / cp_size`` pages, :mod:`.ownership`). page_size: tokens per page.
        split: how the current tokens are split over the CP group, seen from this rank (:mod:`.cp_split`: the
            serving path takes upstream's, :func:`~.cp_split.upstream_interleave_split`; ``cp_size = 1``: no CP).
        checked: checked mode; default from ``SGLANG_CPKV_CHECKED`` (:mod:`.checked`).
        staging: the pinned buffer reserved at start-up on the plan's device (the serving hook's); None: one sized
            for this batch (tools, tests).

    Raises:
        CpSharedKvError: page ids outside ``[0, C)`` or repeated within a request (host table), a batch
            without current tokens, lengths that do not fit the page table, a dense view past int32 locations,
            ``out_cache_loc`` length != ``sum(extend_lens)``, a split of another number of tokens; in checked mode
            also every device-side error and broken invariant.
    """
    cp_size, cp_rank = split.cp_size, split.cp_rank
    _check_page_ids(capacity, page_size, cp_size)
    prefix, extend = _validate_lengths(prefix_lens, extend_lens)
    num_requests = len(prefix)
    num_tokens = sum(extend)
    if split.num_tokens != num_tokens:
        raise CpSharedKvError(f"the CP split is of {split.num_tokens} tokens, the batch extends {num_tokens}")
    if num_tokens == 0:
        # Every per-layer op fills or persists current rows; upstream never runs an extend without them.
        raise CpSharedKvError(f"the batch has no current tokens (extend_lens {list(extend)}): nothing to extend")
    has_history = any(prefix)
    table = _host_page_table(page_table, num_requests)
    pages_needed = _pages_needed(table.shape[1], prefix, extend, page_size)
    _check_current_locations(out_cache_loc, num_tokens, capacity, page_size)
    device = out_cache_loc.device

    # The page ids on the host: a host table's, or the one host copy of a device table when some request has history
    # (module docstring: the layout is a function of them). Without history every entry is its own slot whatever its
    # page id, so a device table's ids stay on the device.
    pages_on_host = table.device.type == "cpu" or has_history
    layout = _BatchLayout(
        (table.cpu() if has_history else table) if pages_on_host else None,
        table.shape[1],
        prefix,
        extend,
        pages_needed,
        page_size=page_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        capacity=capacity,
        validate=table.device.type == "cpu",
    )
    needed = layout.region_slots + layout.own_slots
    num_slots = round_dense_slots(needed)
    if num_slots * page_size > INT32_MAX:
        raise CpSharedKvError(
            f"the batch's dense view needs {num_slots} slots x page_size {page_size} = {num_slots * page_size} "
            f"locations, more than int32 holds ({INT32_MAX}): split the batch"
        )

    # Every host value the device work needs, in one staging (the error counter's zeros too); each slot's page from
    # the host ids, or from the entries gathered on the device.
    if staging is None:
        staging = PlanStaging(staging_bytes(layout.num_entries, num_slots), device)
    elif staging.device != device:
        raise CpSharedKvError(f"the plan's staging is on {staging.device}, the batch's out_cache_loc on {device}")
    (entry_req, token_ends, dense_offsets, *flat_entries), int32_dev = staging.stage(layout, num_slots)
    errors, entry_slots, pool_copy_pages, pool_copy_slots, view_src, view_dst, *host_pages = int32_dev
    if pages_on_host:
        entry_pages, slot_pages = host_pages
    else:  # no history: every entry is its own slot, in entry order
        entry_pages = _entry_pages(table, *flat_entries, capacity)
        slot_pages = torch.cat(
            [entry_pages, torch.full((num_slots - needed,), PADDING_ID, dtype=torch.int32, device=device)]
        )
    inverse = ops.build_page_inverse(entry_pages, entry_req, num_requests, capacity, errors, entry_slots=entry_slots)
    current_dense_locs = ops.current_dense_locs(token_ends, dense_offsets, out_cache_loc, slot_pages, page_size, errors)

    plan = CpSharedKvPlan(
        num_requests=num_requests,
        capacity=capacity,
        page_size=page_size,
        prefix_lens=prefix,
        extend_lens=extend,
        request_pages=pages_needed,
        entry_starts=layout.entry_starts,
        entry_slots_host=torch.from_numpy(layout.entry_slots),
        history_region_slots=layout.region_slots,
        gather_blocks=layout.gather_blocks,
        needed_slots=needed,
        num_slots=num_slots,
        num_tokens=num_tokens,
        split=split,
        checked=envs.SGLANG_CPKV_CHECKED.get() if checked is None else checked,
        slot_pages=slot_pages,
        inverse=inverse,
        current_dense_locs=current_dense_locs,
        pool_copy_pages=pool_copy_pages,
        pool_copy_slots=pool_copy_slots,
        view_copy_src_slots=view_src,
        view_copy_dst_slots=view_dst,
        out_cache_loc=out_cache_loc,
        owned_cache_write_locs=_owned_cache_write_locs(out_cache_loc, page_size, cp_size, cp_rank),
        errors=errors,
    )
    if plan.checked:
        check_plan(plan)
    return plan


def check_plan(plan: CpSharedKvPlan) -> None:
    """Checked mode's plan invariants (:mod:`.checked`); raises :class:`CpSharedKvError`: no op dropped a bad id; the
    entries, the slots and the inverse agree (entry ``(r, j)`` holding page ``p`` points at a slot that holds ``p``,
    and the inverse finds it for ``(r, p)`` and holds nothing else); no page id twice in one request; a history-region
    slot belongs to no request and holds a page no other region slot holds; an own slot belongs to the one request
    whose entry points at it; every current token's dense location is at its own position in an own slot of its
    request, and no dense location is written by two tokens; padded local rows have request id -1 and location -1."""
    plan.raise_if_errors("plan build")
    slot_pages = plan.slot_pages.to(torch.int64).cpu()
    slot_req = plan.slot_req.cpu()
    region = plan.history_region_slots
    region_pages = slot_pages[:region]
    if bool((slot_req[:region] != -1).any()) or region_pages.unique().numel() != region:
        raise CpSharedKvError("the history region holds a request's slot or a page id twice")
    inverse = plan.inverse
    for r in range(plan.num_requests):
        slots = plan.request_slots(r)
        pages = slot_pages[slots]
        uniq, counts = pages.unique(return_counts=True)
        if bool((counts > 1).any()):
            raise CpSharedKvError(f"request {r}: page ids {uniq[counts > 1].tolist()} appear twice in its page table")
        own = slots >= region
        if not bool((slot_req[slots[own]] == r).all()):
            raise CpSharedKvError(f"request {r}: its own slots {slots[own].tolist()} are not all its own")
        got = lookup_slots(inverse, torch.full_like(pages, r).to(inverse.device), pages.to(inverse.device)).cpu()
        if not torch.equal(got, slots):
            raise CpSharedKvError(
                f"inverse disagrees with request {r}'s entries: page ids {pages.tolist()} -> slots {got.tolist()}, "
                f"expected {slots.tolist()}"
            )
    own_slots = plan.entry_slots_host[plan.entry_slots_host >= region]
    if own_slots.unique().numel() != own_slots.numel():
        raise CpSharedKvError("an own slot is pointed at by two entries")
    if bool((slot_pages[plan.needed_slots :] != -1).any()) or bool((slot_req[plan.needed_slots :] != -1).any()):
        raise CpSharedKvError("the layout's rounding slots hold a page or a request")
    held = inverse.held_entries()
    if held != plan.entries:
        raise CpSharedKvError(f"inverse holds {held} entries, the batch's tables {plan.entries}")

    dense = plan.current_dense_locs.to(torch.int64).cpu()
    expected = torch.tensor(
        [
            plan.dense_location(r, p)
            for r, (pre, ext) in enumerate(zip(plan.prefix_lens, plan.extend_lens))
            for p in range(pre, pre + ext)
        ],
        dtype=torch.int64,
    )
    wrong = (dense != expected).nonzero().flatten().tolist()
    if wrong:
        req = plan.token_req_id.cpu()
        raise CpSharedKvError(
            "current tokens do not land at their own request's position (token, request, dense loc, expected): "
            f"{[(t, int(req[t]), int(dense[t]), int(expected[t])) for t in wrong[:8]]}"
        )
    if dense.unique().numel() != dense.numel():
        raise CpSharedKvError("two current tokens write the same dense location")
    token_req = plan.token_req_id.cpu()
    writer_slot = torch.div(dense, plan.page_size, rounding_mode="floor")
    if bool((writer_slot < region).any()) or not torch.equal(slot_req[writer_slot], token_req):
        raise CpSharedKvError("a current token writes a history-region slot or another request's slot")
    local_req = plan.local_req_id.cpu()
    local_loc = plan.local_out_cache_loc.cpu()
    if not torch.equal(local_req < 0, local_loc < 0):
        raise CpSharedKvError("CP split: padded rows of request ids and locations disagree")


def dense_to_pool_locs(plan: CpSharedKvPlan, dense_locs: torch.Tensor) -> torch.Tensor:
    """Dense-view locations back to token locations ``page_id * page_size + offset`` (upstream's ``req_to_token``
    numbering, the one every rank shares) through the plan (-1 stays -1); dtype of ``dense_locs``.

    Dense location ``d`` is slot ``d // page_size`` at offset ``d % page_size``; the slot's page is
    ``plan.slot_pages[slot]``. A location outside the dense view (below -1 included), or on a slot no page
    fills, maps to -1 and is counted as a bad id in the plan's error counter (no host sync).
    """
    page_size = plan.page_size
    locs = dense_locs.to(torch.int64)
    in_view = (locs >= 0) & (locs < plan.dense_rows)
    slot = torch.div(torch.where(in_view, locs, torch.zeros_like(locs)), page_size, rounding_mode="floor")
    page = plan.slot_pages.to(torch.int64)[slot]
    mapped = in_view & (page >= 0)
    plan.errors[ERR_LOC_OUT_OF_RANGE] += ((locs != PADDING_ID) & ~mapped).sum().to(plan.errors.dtype)
    pool = page * page_size + locs % page_size
    return torch.where(mapped, pool, torch.full_like(pool, PADDING_ID)).to(dense_locs.dtype)
