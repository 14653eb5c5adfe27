"""The per-batch CP shared-KV plan: built once per batch, reused by every layer.

:func:`build_plan` turns the batch's request page tables, host lengths and current-token pool
locations into a frozen :class:`CpSharedKvPlan`: every per-batch value the layers need, computed once
(the per-layer work is :class:`~sglang_cpkv.runtime.pipeline.LayerPipeline`, which only reads it).
Terms (page id, capacity ``C``, request row ``r``, page index ``j``, dense slot, per-request inverse)
are those of ``docs/design/cp-shared-kv-contract.md``.

Dense layout (ragged): request ``r`` needs ``n_r = ceil((prefix_r + extend_r) / page_size)`` pages;
its slots are ``start[r] + j`` for ``j < n_r``, ``start`` the exclusive cumulative sum of ``n_r``. The
view has :func:`~.buckets.round_dense_slots` ``(sum n_r)`` slots (under 3.2% more, so shapes repeat);
the rounding slots hold no page. Every dense location is checked to fit int32 here.

Synchronization: the plan's device work is a handful of ops with no host sync
(``repeat_interleave`` gets ``output_size``). Host-side lengths are validated always (free). Page ids
and ``out_cache_loc`` are validated on the host when they are host tensors; on a GPU a bad or repeated
page id is counted in the plan's device error counter instead (the surfacing is the caller's: checked
mode raises at once). One host sync per batch, before the first layer, under ``cp_size > 1`` only: the
all-gather layout of history pages needs the history page ids on the host (deduplicated owned pages,
padded to the largest owner's count), so the history pages of a device page table are copied to the
host once; a host page table needs none.

Pools under CP: page ids are global (upstream's page-interleave allocator numbers ``C = cp_size x`` one rank's
pool pages); a rank's pool holds the pages it owns, page ``p`` at its pool page ``p // cp_size``
(:mod:`.ownership`). Every pool address the plan hands out (the pages a rank packs for the exchange, the rows it
persists) is such a pool page or row; every dense and remap input stays in page ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_cpkv import ops
from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE, CpSharedKvError
from sglang_cpkv.runtime import checked as checked_mode
from sglang_cpkv.runtime.buckets import round_dense_slots
from sglang_cpkv.runtime.cp_split import CpSplit, CpStrategy, build_cp_split
from sglang_cpkv.runtime.ownership import owner_pool_loc, owner_pool_page, page_owner, pool_pages_per_rank

PADDING_ID = -1
INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True, eq=False)
class ExchangeRound:
    """One round of the history all-gather (device tensors).

    Attributes:
        send_pages: int32 ``[K]``: the pages of this rank's pool it packs (the round's share of its owned
            distinct history pages, at :func:`~.ownership.owner_pool_page`; -1 padding).
        history_slots: int32 ``[S_t]``: the history slots whose page arrives in this round.
        recv_rows: int32 ``[S_t]``: each such slot's page row in the rank-major all-gathered
            ``[cp_size * K, page_elems]`` buffer.
    """

    send_pages: torch.Tensor
    history_slots: torch.Tensor
    recv_rows: torch.Tensor


@dataclass(frozen=True, eq=False)
class CpSharedKvPlan:
    """Everything the layers of one batch reuse. Built by :func:`build_plan`; never mutated.

    Host attributes:
        num_requests: ``R``. capacity: ``C``, the page ids (under CP ``cp_size`` x :attr:`pool_pages`).
        page_size: tokens per page.
        prefix_lens, extend_lens: per request, history and current token counts.
        request_pages: ``n_r`` per request; slot_starts: ``start[r]`` per request.
        num_slots: slots of the dense view (``sum(n_r)`` rounded, module docstring).
        num_tokens: ``N = sum(extend_lens)``.
        split: the CP split of the current tokens (:class:`~.cp_split.CpSplit`).
        exchange_pages_per_rank: ``M``, the most distinct history pages any rank owns (0 when
            ``cp_size == 1`` or the batch has no history).
        exchange_pages_per_round: ``K``, pages each rank contributes to one round of the history
            all-gather (``M``, or the caller's bound when ``M`` exceeds it: reserved exchange buffers); 0 without
            exchange.
        checked: checked mode (:mod:`.checked`), fixed at build.

    Device tensors (all on the device of ``out_cache_loc``):
        slot_pages: int32 ``[num_slots]``, the pool page id of each dense slot (-1: a rounding slot).
        slot_req: int64 ``[num_slots]``, the request of each dense slot (-1: a rounding slot).
        inverse: int32 ``[R * C]``, the per-request inverse (``ops.build_page_inverse``).
        token_req_id: int64 ``[N]``, request row of each current token (token order).
        current_dense_locs: int64 ``[N]``, dense location of each current token (fill target).
        history_slots: int32 ``[S]``, the dense slots ``start[r] + j`` with ``j < ceil(prefix_r / page_size)``
            (slots holding only current tokens are never materialized).
        history_pages: int32 ``[S]``, the pool page id of each history slot.
        local_req_id: int64 ``[physical_rows]``, request row of each local query row of this
            rank (the companion of the split; padding rows -1).
        local_out_cache_loc: ``[physical_rows]`` (dtype of ``out_cache_loc``), the split
            ``out_cache_loc`` (padding rows -1).
        local_token_index: int64 ``[per_rank_logical[cp_rank]]``, global token of each real local row.
        current_gather_index: int64 ``[N]``, see :meth:`CpSplit.unshard`.
        owned_cache_write_locs: int64 ``[N]``: the row of this rank's pool of each current token whose page
            it owns (:func:`~.ownership.page_owner`, :func:`~.ownership.owner_pool_loc`), else -1.
        exchange_rounds: ``ceil(M / K)`` :class:`ExchangeRound` (the same count on every rank): the
            history all-gather in rounds of ``K`` pages per rank.
        errors: int32 ``[NUM_ERROR_KINDS]`` device error counter shared by every op of the batch.
    """

    num_requests: int
    capacity: int
    page_size: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    request_pages: tuple[int, ...]
    slot_starts: tuple[int, ...]
    num_slots: int
    num_tokens: int
    split: CpSplit
    exchange_pages_per_rank: int
    exchange_pages_per_round: int
    checked: bool
    slot_pages: torch.Tensor
    slot_req: torch.Tensor
    inverse: torch.Tensor
    token_req_id: torch.Tensor
    current_dense_locs: torch.Tensor
    history_slots: torch.Tensor
    history_pages: torch.Tensor
    local_req_id: torch.Tensor
    local_out_cache_loc: torch.Tensor
    local_token_index: torch.Tensor
    current_gather_index: torch.Tensor
    owned_cache_write_locs: torch.Tensor
    exchange_rounds: tuple[ExchangeRound, ...]
    errors: torch.Tensor

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
    def dense_rows(self) -> int:
        """Rows of the dense view: ``num_slots * page_size``."""
        return self.num_slots * self.page_size

    @property
    def needed_slots(self) -> int:
        """Slots the batch's pages fill: ``sum(n_r)`` (the view rounds it up to ``num_slots``)."""
        return sum(self.request_pages)

    def slot_start(self, request: int) -> int:
        """The first dense slot of ``request``."""
        return self.slot_starts[request]

    def slot_range(self, request: int) -> tuple[int, int]:
        """``[start, stop)`` of the dense slots that belong to ``request``."""
        start = self.slot_starts[request]
        return start, start + self.request_pages[request]

    def dense_location(self, request: int, position: int) -> int:
        """The dense location of logical position ``position`` of ``request`` (host arithmetic)."""
        return (self.slot_start(request) + position // self.page_size) * self.page_size + position % self.page_size

    def raise_if_errors(self, where: str = "CP shared-KV batch") -> None:
        """Synchronize and raise :class:`CpSharedKvError` if any op of the batch dropped a bad id."""
        ops.raise_if_errors(self.errors, where)


def _to_device(host: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without a host sync (pinned staging on CUDA)."""
    if dtype is not None:
        host = host.to(dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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
    prefix = tuple(int(n) for n in prefix_lens)
    extend = tuple(int(n) for n in extend_lens)
    if len(prefix) != len(extend):
        raise CpSharedKvError(f"prefix_lens has {len(prefix)} entries, extend_lens {len(extend)}")
    if not prefix:
        raise CpSharedKvError("empty batch: no requests")
    for name, lens in (("prefix_lens", prefix), ("extend_lens", extend)):
        bad = [(r, n) for r, n in enumerate(lens) if n < 0]
        if bad:
            raise CpSharedKvError(f"{name} must be >= 0: (request, length) {bad}")
    return prefix, extend


def _validate_host_locations(out_cache_loc: torch.Tensor, capacity: int, page_size: int) -> None:
    """Current-token locations inside the pool (host tensor only)."""
    lo, hi = int(out_cache_loc.min()), int(out_cache_loc.max())
    if lo < 0 or hi >= capacity * page_size:
        raise CpSharedKvError(
            f"out_cache_loc values span [{lo}, {hi}], outside the pool [0, capacity*page_size={capacity * page_size})"
        )


def _validate_host_ids(table: torch.Tensor, pages_needed: list[int], capacity: int) -> None:
    """Page ids of used entries in ``[0, C)`` and distinct within each request (host table only)."""
    for r, used in enumerate(pages_needed):
        row = table[r, :used].to(torch.int64)
        bad = ((row < 0) | (row >= capacity)).nonzero().flatten().tolist()
        if bad:
            raise CpSharedKvError(
                f"request {r}: page ids outside [0, capacity={capacity}) at page index/value "
                f"{[(j, int(row[j])) for j in bad]}"
            )
        uniq, counts = row.unique(return_counts=True)
        if bool((counts > 1).any()):
            raise CpSharedKvError(f"request {r}: page ids {uniq[counts > 1].tolist()} appear twice in its page table")


def _exchange_layout(
    history_page_ids: torch.Tensor, cp_size: int, cp_rank: int, pages_per_round: int | None
) -> tuple[int, int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """``(M, K, rounds)``: per round this rank's send pool pages ``[K]``, the indices of the history slots whose
    page arrives in it, and their rows in the gathered buffer; all host int64."""
    if history_page_ids.numel() == 0:
        return 0, 0, []
    unique_pages = history_page_ids.unique(sorted=True)
    owner = page_owner(unique_pages, cp_size)
    owned = [unique_pages[owner == k] for k in range(cp_size)]
    pages_per_rank = max(int(t.numel()) for t in owned)
    # A round never carries more than the batch needs: the bound only splits a larger exchange into rounds.
    per_round = pages_per_rank if pages_per_round is None else min(pages_per_rank, pages_per_round)
    slot_owner = page_owner(history_page_ids, cp_size)
    index_in_owner = torch.empty_like(history_page_ids)
    for k in range(cp_size):
        mine = slot_owner == k
        index_in_owner[mine] = torch.searchsorted(owned[k], history_page_ids[mine])
    slot_round = torch.div(index_in_owner, per_round, rounding_mode="floor")
    recv_rows = slot_owner * per_round + index_in_owner % per_round
    rounds = []
    for r in range(-(-pages_per_rank // per_round)):
        send = torch.full((per_round,), PADDING_ID, dtype=torch.int64)
        share = owned[cp_rank][r * per_round : (r + 1) * per_round]
        send[: share.numel()] = owner_pool_page(share, cp_size)
        in_round = (slot_round == r).nonzero().flatten()
        rounds.append((send, in_round, recv_rows[in_round]))
    return pages_per_rank, per_round, rounds


def _slot_pages(table: torch.Tensor, slot_req: torch.Tensor, slot_j: torch.Tensor, capacity: int) -> torch.Tensor:
    """int32 page id of every used slot, gathered on the table's device. An id outside ``[0, C)`` becomes ``C``
    before the int32 cast (so ``2**32 + 5`` cannot wrap to page 5): the inverse build counts it as bad."""
    if table.device.type != "cpu":  # staged through pinned memory: no host sync
        slot_req, slot_j = _to_device(slot_req, table.device), _to_device(slot_j, table.device)
    pages = table.to(torch.int64)[slot_req, slot_j]
    return torch.where((pages >= 0) & (pages < capacity), pages, capacity).to(torch.int32)


def build_plan(
    page_table: torch.Tensor | Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    *,
    capacity: int,
    page_size: int,
    cp_size: int,
    cp_rank: int,
    strategy: CpStrategy,
    exchange_pages_per_round: int | None = None,
    checked: bool | None = None,
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
        cp_size, cp_rank: the CP group (``cp_size = 1``: no CP). strategy: see :mod:`.cp_split`.
        exchange_pages_per_round: ``K``, the most pages a rank sends in one round of the history all-gather
            (the size of reserved exchange buffers); default: all its pages in one round.
        checked: checked mode; default from ``SGLANG_CPKV_CHECKED`` (:mod:`.checked`).

    Raises:
        CpSharedKvError: page ids outside ``[0, C)`` or repeated within a request (host table), a batch
            without current tokens, lengths that do not fit the page table, a dense view past int32 locations,
            ``out_cache_loc`` length != ``sum(extend_lens)``, a CP split that does not apply, a rank
            outside ``[0, cp_size)``; in checked mode also every device-side error and broken invariant.
    """
    if capacity < 1 or page_size < 1:
        raise CpSharedKvError(f"capacity and page_size must be >= 1, got capacity={capacity}, page_size={page_size}")
    if capacity > INT32_MAX:
        raise CpSharedKvError(f"capacity {capacity} page ids do not fit int32")
    if cp_size > 1 and capacity % cp_size:
        raise CpSharedKvError(
            f"capacity {capacity} is not a multiple of cp_size {cp_size}: under CP the page ids number cp_size x "
            "one rank's pool pages (upstream's page-interleave allocator)"
        )
    if exchange_pages_per_round is not None and exchange_pages_per_round < 1:
        raise CpSharedKvError(f"exchange_pages_per_round must be >= 1, got {exchange_pages_per_round}")
    prefix, extend = _validate_lengths(prefix_lens, extend_lens)
    num_requests = len(prefix)
    split = build_cp_split(strategy, extend, cp_size, cp_rank)
    num_tokens = split.num_tokens
    if num_tokens == 0:
        # Every per-layer op fills or persists current rows; upstream never runs an extend without them.
        raise CpSharedKvError(f"the batch has no current tokens (extend_lens {list(extend)}): nothing to extend")

    pages_needed = [-(-(p + e) // page_size) for p, e in zip(prefix, extend)]
    starts = [0]
    for n in pages_needed[:-1]:
        starts.append(starts[-1] + n)
    num_slots = round_dense_slots(sum(pages_needed))
    if num_slots * page_size > INT32_MAX:
        raise CpSharedKvError(
            f"the batch's dense view needs {num_slots} slots x page_size {page_size} = {num_slots * page_size} "
            f"locations, more than int32 holds ({INT32_MAX}): split the batch"
        )
    table = _host_page_table(page_table, num_requests)
    too_long = [(r, n) for r, n in enumerate(pages_needed) if n > table.shape[1]]
    if too_long:
        raise CpSharedKvError(
            f"page_table has {table.shape[1]} columns but (request, pages needed) {too_long} do not fit"
        )
    if table.device.type == "cpu":
        _validate_host_ids(table, pages_needed, capacity)

    if not isinstance(out_cache_loc, torch.Tensor) or out_cache_loc.dim() != 1:
        raise CpSharedKvError("out_cache_loc must be a 1-D tensor of pool token locations")
    if out_cache_loc.numel() != num_tokens:
        raise CpSharedKvError(f"out_cache_loc has {out_cache_loc.numel()} entries, sum(extend_lens) = {num_tokens}")
    if out_cache_loc.dtype not in (torch.int32, torch.int64):
        raise CpSharedKvError(f"out_cache_loc must be int32 or int64, got {out_cache_loc.dtype}")
    if out_cache_loc.device.type == "cpu":
        _validate_host_locations(out_cache_loc, capacity, page_size)

    device = out_cache_loc.device
    errors = ops.new_error_counter(device)

    # Every used slot's (request, page index), on the host: the layout is a function of host lengths.
    slot_req_host = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(pages_needed))
    slot_j_host = torch.cat([torch.arange(n) for n in pages_needed])
    used_pages = _slot_pages(table, slot_req_host, slot_j_host, capacity)
    slot_pages = torch.full((num_slots,), PADDING_ID, dtype=torch.int32, device=device)
    slot_pages[: used_pages.numel()] = used_pages if used_pages.device == device else _to_device(used_pages, device)
    slot_req = _to_device(
        torch.cat([slot_req_host, torch.full((num_slots - slot_req_host.numel(),), PADDING_ID)]), device, torch.int64
    )
    inverse = ops.build_page_inverse(slot_pages, slot_req, num_requests, capacity, errors)

    extend_dev = _to_device(torch.tensor(extend, dtype=torch.int64), device)
    token_req_id = torch.repeat_interleave(
        torch.arange(num_requests, dtype=torch.int64, device=device), extend_dev, output_size=num_tokens
    )
    current_dense_locs = ops.remap_locs(
        out_cache_loc, token_req_id, inverse, num_requests, capacity, page_size, errors
    ).to(torch.int64)

    history_slots_host = torch.cat(
        [torch.arange(start, start + -(-p // page_size), dtype=torch.int64) for start, p in zip(starts, prefix)]
    )
    history_slots = _to_device(history_slots_host, device, torch.int32)
    history_pages = slot_pages.index_select(0, history_slots.to(torch.int64))

    local_token_index = _to_device(split.local_token_index, device)
    current_gather_index = _to_device(split.gather_index, device)
    local_req_id = split.shard(token_req_id, PADDING_ID, local_token_index)
    local_out_cache_loc = split.shard(out_cache_loc, PADDING_ID, local_token_index)

    pages_per_rank, pages_per_round, rounds = 0, 0, ()
    if cp_size == 1:
        owned_cache_write_locs = out_cache_loc.to(torch.int64)
    else:
        locs = out_cache_loc.to(torch.int64)
        owned = page_owner(torch.div(locs, page_size, rounding_mode="floor"), cp_size) == cp_rank
        owned_cache_write_locs = torch.where(owned, owner_pool_loc(locs, page_size, cp_size), PADDING_ID)
        # The one host copy of a device page table (see the module docstring): the history slots' pages, when any.
        history_page_ids = torch.empty(0, dtype=torch.int64)
        if history_slots_host.numel():
            history_page_ids = (
                used_pages.index_select(0, history_slots_host.to(used_pages.device)).to(torch.int64).cpu()
            )
        pages_per_rank, pages_per_round, host_rounds = _exchange_layout(
            history_page_ids, cp_size, cp_rank, exchange_pages_per_round
        )
        rounds = tuple(
            ExchangeRound(
                send_pages=_to_device(send, device, torch.int32),
                history_slots=_to_device(history_slots_host[in_round], device, torch.int32),
                recv_rows=_to_device(recv, device, torch.int32),
            )
            for send, in_round, recv in host_rounds
        )

    plan = CpSharedKvPlan(
        num_requests=num_requests,
        capacity=capacity,
        page_size=page_size,
        prefix_lens=prefix,
        extend_lens=extend,
        request_pages=tuple(pages_needed),
        slot_starts=tuple(starts),
        num_slots=num_slots,
        num_tokens=num_tokens,
        split=split,
        exchange_pages_per_rank=pages_per_rank,
        exchange_pages_per_round=pages_per_round,
        checked=checked_mode.enabled() if checked is None else checked,
        slot_pages=slot_pages,
        slot_req=slot_req,
        inverse=inverse,
        token_req_id=token_req_id,
        current_dense_locs=current_dense_locs,
        history_slots=history_slots,
        history_pages=history_pages,
        local_req_id=local_req_id,
        local_out_cache_loc=local_out_cache_loc,
        local_token_index=local_token_index,
        current_gather_index=current_gather_index,
        owned_cache_write_locs=owned_cache_write_locs,
        exchange_rounds=rounds,
        errors=errors,
    )
    if plan.checked:
        checked_mode.check_plan(plan)
    return plan


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
