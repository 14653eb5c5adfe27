"""The per-batch CP shared-KV plan: built once per batch, reused by every layer.

:func:`build_plan` turns the batch's request page tables, host lengths and current-token pool
locations into a frozen :class:`CpSharedKvPlan` of device tensors; the per-layer functions of
:mod:`sglang_cpkv.runtime.layer` only read it. Terms (page id, capacity ``C``, request row
``r``, page index ``j``, ``P``, dense slot ``r * P + j``, per-request inverse) are those of
``docs/design/cp-shared-kv-contract.md``.

Synchronization: the plan's device work is a handful of ops with no host sync
(``repeat_interleave`` gets ``output_size``). Host-side lengths are validated always (free).
Page ids and ``out_cache_loc`` are validated on the host when they are host tensors; on a GPU
they are counted in the plan's device error counter instead (:meth:`CpSharedKvPlan.raise_if_errors`
surfaces it at a natural sync point; checked mode raises at once). One exception: under
``cp_size > 1`` the all-gather layout of history pages needs the history page ids on the host
(deduplicated owned pages, padded to the largest owner's count), so a device page table is copied
to the host once per batch; pass a host page table when the caller has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_cpkv import ops
from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime import checked as checked_mode
from sglang_cpkv.runtime.buckets import bucket_pages_per_request
from sglang_cpkv.runtime.cp_split import CpSplit, CpStrategy, build_cp_split

PADDING_ID = -1


@dataclass(frozen=True, eq=False)
class CpSharedKvPlan:
    """Everything the layers of one batch reuse. Built by :func:`build_plan`; never mutated.

    Host attributes:
        num_requests: ``R``. pages_per_request: ``P`` (a bucket, :mod:`.buckets`).
        capacity: ``C``. page_size: tokens per page.
        prefix_lens, extend_lens: per request, history and current token counts.
        num_tokens: ``N = sum(extend_lens)``.
        split: the CP split of the current tokens (:class:`~.cp_split.CpSplit`).
        exchange_pages_per_rank: ``M``, pages each rank contributes to the history all-gather
            (0 when ``cp_size == 1`` or the batch has no history).
        checked: checked mode (:mod:`.checked`), fixed at build.

    Device tensors (all on the device of ``out_cache_loc``):
        page_table: int32 ``[R, P]``; -1 past each request's ``ceil((prefix+extend)/page_size)`` pages.
        inverse: int32 ``[R * C]``, the per-request inverse (``ops.build_page_inverse``).
        token_req_id: int64 ``[N]``, request row of each current token (token order).
        current_dense_locs: int32 ``[N]``, dense location of each current token (fill target).
        history_slots: int32 ``[S]``, dense slots ``r * P + j`` with ``j < ceil(prefix_r / page_size)``
            (slots holding only current tokens are never materialized).
        history_pages: int32 ``[S]``, the pool page id of each history slot.
        local_req_id: int64 ``[physical_rows]``, request row of each local query row of this
            rank (the companion of the split; padding rows -1).
        local_out_cache_loc: ``[physical_rows]`` (dtype of ``out_cache_loc``), the split
            ``out_cache_loc`` (padding rows -1).
        local_token_index: int64 ``[per_rank_logical[cp_rank]]``, global token of each real local row.
        current_gather_index: int64 ``[N]``, see :meth:`CpSplit.unshard`.
        owned_cache_write_locs: ``[N]`` (dtype of ``out_cache_loc``): the pool location of each
            current token whose page this rank owns (``page_id % cp_size == cp_rank``), else -1.
        exchange_send_pages: int32 ``[M]``: pool page ids this rank packs for the history
            all-gather (its owned distinct history pages, -1 padding).
        exchange_recv_rows: int32 ``[S]``: for each history slot, its page's row in the
            rank-major all-gathered ``[cp_size * M, page_elems]`` buffer.
        errors: int32 ``[NUM_ERROR_KINDS]`` device error counter shared by every op of the batch.
    """

    num_requests: int
    pages_per_request: int
    capacity: int
    page_size: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    num_tokens: int
    split: CpSplit
    exchange_pages_per_rank: int
    checked: bool
    page_table: torch.Tensor
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
    exchange_send_pages: torch.Tensor
    exchange_recv_rows: torch.Tensor
    errors: torch.Tensor

    @property
    def cp_size(self) -> int:
        return self.split.cp_size

    @property
    def cp_rank(self) -> int:
        return self.split.cp_rank

    @property
    def device(self) -> torch.device:
        return self.inverse.device

    @property
    def dense_rows(self) -> int:
        """Rows of the dense view: ``R * P * page_size``."""
        return self.num_requests * self.pages_per_request * self.page_size

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
    history_page_ids: torch.Tensor, cp_size: int, cp_rank: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(M, this rank's send page ids [M], recv row of each history slot [S]); all host int64."""
    if history_page_ids.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return 0, empty, empty
    unique_pages = history_page_ids.unique(sorted=True)
    owner = unique_pages % cp_size
    owned = [unique_pages[owner == k] for k in range(cp_size)]
    pages_per_rank = max(int(t.numel()) for t in owned)
    send = torch.full((pages_per_rank,), PADDING_ID, dtype=torch.int64)
    send[: owned[cp_rank].numel()] = owned[cp_rank]
    slot_owner = history_page_ids % cp_size
    recv_rows = torch.empty_like(history_page_ids)
    for k in range(cp_size):
        mine = slot_owner == k
        recv_rows[mine] = k * pages_per_rank + torch.searchsorted(owned[k], history_page_ids[mine])
    return pages_per_rank, send, recv_rows


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
    pages_per_request: int | None = None,
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
        capacity: ``C``, page ids of the pool. page_size: tokens per page.
        cp_size, cp_rank: the CP group (``cp_size = 1``: no CP). strategy: see :mod:`.cp_split`.
        pages_per_request: ``P``; default the bucket of the batch's largest page count.
        checked: checked mode; default from ``SGLANG_CPKV_CHECKED`` (:mod:`.checked`).

    Raises:
        CpSharedKvError: page ids outside ``[0, C)`` or repeated within a request (host table),
            lengths that do not fit ``pages_per_request`` or the page table, ``out_cache_loc``
            length != ``sum(extend_lens)``, a CP split that does not apply, a rank outside
            ``[0, cp_size)``; in checked mode also every device-side error and broken invariant.
    """
    if capacity < 1 or page_size < 1:
        raise CpSharedKvError(f"capacity and page_size must be >= 1, got capacity={capacity}, page_size={page_size}")
    prefix, extend = _validate_lengths(prefix_lens, extend_lens)
    num_requests = len(prefix)
    split = build_cp_split(strategy, extend, cp_size, cp_rank)
    num_tokens = split.num_tokens

    pages_needed = [-(-(p + e) // page_size) for p, e in zip(prefix, extend)]
    if pages_per_request is None:
        pages_per_request = bucket_pages_per_request(max(pages_needed))
    elif max(pages_needed) > pages_per_request:
        r = max(range(num_requests), key=lambda i: pages_needed[i])
        raise CpSharedKvError(
            f"request {r} needs {pages_needed[r]} pages (prefix {prefix[r]} + extend {extend[r]} tokens, "
            f"page_size {page_size}) > pages_per_request={pages_per_request}"
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
    if out_cache_loc.device.type == "cpu" and num_tokens:
        lo, hi = int(out_cache_loc.min()), int(out_cache_loc.max())
        if lo < 0 or hi >= capacity * page_size:
            raise CpSharedKvError(
                f"out_cache_loc values span [{lo}, {hi}], outside the pool [0, capacity*page_size={capacity * page_size})"
            )

    device = out_cache_loc.device
    errors = ops.new_error_counter(device)

    # Page table [R, P] int32: -1 past each request's own pages (W may be wider or narrower than P).
    width = min(table.shape[1], pages_per_request)
    used = torch.arange(pages_per_request).unsqueeze(0) < torch.tensor(pages_needed).unsqueeze(1)
    dense_table = torch.full((num_requests, pages_per_request), PADDING_ID, dtype=torch.int32, device=device)
    columns = table[:, :width]
    dense_table[:, :width] = (
        columns.to(torch.int32) if columns.device == device else _to_device(columns, device, torch.int32)
    )
    dense_table = torch.where(_to_device(used, device), dense_table, PADDING_ID)
    inverse = ops.build_page_inverse(dense_table, capacity, errors)

    extend_dev = _to_device(torch.tensor(extend, dtype=torch.int64), device)
    token_req_id = torch.repeat_interleave(
        torch.arange(num_requests, dtype=torch.int64, device=device), extend_dev, output_size=num_tokens
    )
    current_dense_locs = ops.remap_locs(out_cache_loc, token_req_id, inverse, capacity, page_size, errors)

    history_pages_per_req = [-(-p // page_size) for p in prefix]
    history_slots_host = torch.cat(
        [
            torch.arange(r * pages_per_request, r * pages_per_request + n, dtype=torch.int64)
            for r, n in enumerate(history_pages_per_req)
        ]
    )
    history_slots = _to_device(history_slots_host, device, torch.int32)
    history_pages = dense_table.view(-1).index_select(0, history_slots.to(torch.int64))

    local_token_index = _to_device(split.local_token_index, device)
    current_gather_index = _to_device(split.gather_index, device)
    local_req_id = split.shard(token_req_id, PADDING_ID, local_token_index)
    local_out_cache_loc = split.shard(out_cache_loc, PADDING_ID, local_token_index)

    if cp_size == 1:
        owned_cache_write_locs = out_cache_loc
        pages_per_rank = 0
        send_pages = torch.empty(0, dtype=torch.int32, device=device)
        recv_rows = torch.empty(0, dtype=torch.int32, device=device)
    else:
        owner = torch.div(out_cache_loc, page_size, rounding_mode="floor") % cp_size
        owned_cache_write_locs = torch.where(owner == cp_rank, out_cache_loc, PADDING_ID)
        # The one host copy of a device page table (see the module docstring).
        host_table = table[:, :width].to(torch.int64).cpu()
        history_page_ids = host_table[history_slots_host // pages_per_request, history_slots_host % pages_per_request]
        pages_per_rank, send_host, recv_host = _exchange_layout(history_page_ids, cp_size, cp_rank)
        send_pages = _to_device(send_host, device, torch.int32)
        recv_rows = _to_device(recv_host, device, torch.int32)

    plan = CpSharedKvPlan(
        num_requests=num_requests,
        pages_per_request=pages_per_request,
        capacity=capacity,
        page_size=page_size,
        prefix_lens=prefix,
        extend_lens=extend,
        num_tokens=num_tokens,
        split=split,
        exchange_pages_per_rank=pages_per_rank,
        checked=checked_mode.enabled() if checked is None else checked,
        page_table=dense_table,
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
        exchange_send_pages=send_pages,
        exchange_recv_rows=recv_rows,
        errors=errors,
    )
    if plan.checked:
        checked_mode.check_plan(plan)
    return plan
