"""Torch reference of the CP shared-KV ops: the contract the Triton and CUDA kernels implement, op by op.

Terms (page id, capacity ``C``, request row, dense slot, per-request inverse: :class:`PageInverse`, sized by the
batch's entries) are those of ``docs/design/cp-shared-kv-contract.md``; where each op runs per batch or per layer:
``docs/design/cp-shared-kv.md`` sections 3-4. Per batch :func:`build_page_inverse`, :func:`remap_locs` (also per
layer, top-k) and :func:`current_dense_locs`; per layer :func:`copy_pages`, :func:`scatter_rows` and their fusion
:func:`materialize_and_fill`. Every op skips -1 silently and drops and counts any other out-of-range id
(:mod:`sglang_cpkv.ops.errors`); copies are byte-exact (bf16 rows, the 656-byte packed FP8 rows as ``uint8``).
Clarity over speed: it may synchronize; the dispatcher (:mod:`sglang_cpkv.ops`) picks CUDA or Triton on a GPU.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from sglang_cpkv.ops.errors import (
    ERR_CURRENT_LOC_MISMATCH,
    ERR_LOC_OUT_OF_RANGE,
    ERR_PAGE_OUT_OF_RANGE,
    ERR_REQ_OUT_OF_RANGE,
    CpSharedKvError,
)

PADDING_ID = -1

_Op = TypeVar("_Op", bound=Callable)


def implements(spec: Callable) -> Callable[[_Op], _Op]:
    """Mark a backend's function (or the dispatcher's operand check) as taking the operands of ``spec``, an op of
    this module: their types and meaning are ``spec``'s, stated once there. Checked when the backend is imported,
    names, order and defaults alike (keyword-only tuning knobs may follow), so no backend drifts from the contract."""
    operands = [(p.name, p.default) for p in inspect.signature(spec).parameters.values()]

    def mark(fn: _Op) -> _Op:
        params = inspect.signature(fn).parameters.values()
        taken = [(p.name, p.default) for p in params if p.kind is not p.KEYWORD_ONLY]
        if taken != operands:
            raise TypeError(
                f"{fn.__module__}.{fn.__qualname__} takes {[name for name, _ in taken]}, the contract's "
                f"{spec.__name__} takes {[name for name, _ in operands]} (with the same defaults)"
            )
        return fn

    return mark


def check_ids(t: torch.Tensor, name: str) -> None:
    """Ids and locations are integer tensors: a float or bool id would silently truncate."""
    if t.dtype not in (torch.int32, torch.int64):
        raise CpSharedKvError(f"{name} must be int32 or int64, got {t.dtype}")


def default_slots(entry_pages: torch.Tensor) -> torch.Tensor:
    """``build_page_inverse``'s default slots: entry ``e`` at slot ``e`` (int32; more entries than int32 holds refused)."""
    if entry_pages.numel() > (1 << 31) - 1:
        raise CpSharedKvError(f"{entry_pages.numel()} entries do not fit int32 slots")
    return torch.arange(entry_pages.numel(), dtype=torch.int32, device=entry_pages.device)


def check_slots(entry_slots: torch.Tensor) -> None:
    """Dense slots are int32 (every dense location fits int32, checked at plan build)."""
    if entry_slots.dtype != torch.int32:
        raise CpSharedKvError(f"entry_slots must be int32, got {entry_slots.dtype}")


# Keys of the inverse's table: ``r * C + page`` of an entry, :data:`EMPTY_KEY` in a cell no entry holds.
EMPTY_KEY = -1
# The multiplier of :func:`hash_cells` (murmur2's): under 2**31, so ``low 32 bits x multiplier`` stays inside int64 on
# every backend (no overflow for torch, Triton or CUDA to disagree on).
HASH_MULTIPLIER = 0x5BD1E995


def inverse_table_size(num_entries: int) -> int:
    """Cells of a batch's inverse table: the power of two at or above twice the entries (at least 2), so at most
    half of it is held and a probe sequence always ends at an empty cell within a couple of steps on average."""
    return max(2, 1 << max(0, 2 * num_entries - 1).bit_length())


def inverse_bytes(num_entries: int) -> int:
    """Device bytes of the inverse of a batch of ``num_entries`` page-table entries (int64 key and int32 slot per
    cell); its build allocates nothing else. Non-decreasing in ``num_entries``, so the bound of the most entries a
    batch may have bounds every batch."""
    return inverse_table_size(num_entries) * (8 + 4)


def hash_cells(key: torch.Tensor, table_size: int) -> torch.Tensor:
    """int64, the shape of ``key``: each key's home cell in a table of ``table_size`` (a power of two) cells.

    The low 32 bits times :data:`HASH_MULTIPLIER`, plus the high bits, folded by its upper half: the cell of
    ``r * C + page`` depends on every bit of it (the Triton and CUDA kernels compute the same cell)."""
    high = key >> 32
    mixed = (key - (high << 32)) * HASH_MULTIPLIER + high
    return (mixed ^ (mixed >> 32)) & (table_size - 1)


@dataclass(frozen=True, eq=False)
class PageInverse:
    """The per-request page inverse of a batch: a hash table sized by its entries, never by ``C``.

    Cell ``i`` holds the key ``r * C + page`` of one entry of request ``r`` with its dense slot, or
    :data:`EMPTY_KEY` and slot -1. A key's cells are probed from :func:`hash_cells` on, one cell at a time (wrapping),
    up to the first empty cell; the table is at most half held (:func:`inverse_table_size`), so every probe ends. A
    lookup ``(r, page id)`` finds the slot, or -1 when absent.

    The table is canonical: the one that inserting the batch's distinct keys in ascending order, each into the
    first empty cell of its probe, gives (an ordered hash table: the kernels insert concurrently and a smaller key
    displaces a larger one, which ends in the same cells whatever the order). So every backend builds the same
    tensors, run after run, and a key held twice keeps the slot of its lowest entry.

    Attributes:
        keys: int64 ``[T]``, ``T`` a power of two. slots: int32 ``[T]``, -1 in an empty cell (key ``EMPTY_KEY``).
        num_requests: ``R``. capacity: ``C``, the page ids a lookup may name (a larger one is a bad id).
    """

    keys: torch.Tensor
    slots: torch.Tensor
    num_requests: int
    capacity: int

    @property
    def table_size(self) -> int:
        return self.keys.numel()

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def nbytes(self) -> int:
        """Device bytes the inverse holds for the life of its batch."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.slots))

    def held_entries(self) -> int:
        """Entries the table holds (synchronizes: for checks and tests)."""
        return int((self.keys != EMPTY_KEY).sum())

    def to(self, device: torch.device | str) -> PageInverse:
        return PageInverse(self.keys.to(device), self.slots.to(device), self.num_requests, self.capacity)


def check_inverse(inverse: PageInverse) -> None:
    """The inverse's two tensors agree in size and device and have the table's dtypes (host metadata only)."""
    if not isinstance(inverse, PageInverse):
        raise CpSharedKvError(f"inverse must be a PageInverse (from build_page_inverse), got {type(inverse).__name__}")
    if inverse.capacity < 1 or inverse.num_requests < 0:
        raise CpSharedKvError(
            f"inverse capacity must be >= 1 and num_requests >= 0, got {inverse.capacity}, {inverse.num_requests}"
        )
    for name, dtype in (("keys", torch.int64), ("slots", torch.int32)):
        t = getattr(inverse, name)
        if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous() or t.device != inverse.device:
            raise CpSharedKvError(
                f"inverse.{name} must be a contiguous {dtype} 1-D tensor on {inverse.device}, "
                f"got {t.dtype}{tuple(t.shape)} on {t.device}"
            )
    size = inverse.table_size
    if size < 2 or size & (size - 1) or inverse.slots.numel() != size:
        raise CpSharedKvError(
            f"inverse must hold a power-of-two table (at least 2 cells) of keys and as many slots, got keys "
            f"{size}, slots {inverse.slots.numel()}"
        )


def _check_same_rows(src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise CpSharedKvError(
            f"src and dst must have one dtype and {what} width: src {src.dtype}{tuple(src.shape)}, "
            f"dst {dst.dtype}{tuple(dst.shape)}"
        )
    if src.device != dst.device:
        raise CpSharedKvError(f"src is on {src.device}, dst on {dst.device}")


def check_page_pairs(src: torch.Tensor, src_page: torch.Tensor, dst: torch.Tensor, dst_page: torch.Tensor) -> None:
    """``copy_pages``' operands: one dtype, page width and device; one destination page per source page."""
    _check_same_rows(src, dst, "page")
    if src_page.shape != dst_page.shape:
        raise CpSharedKvError(
            f"src_page and dst_page must have one shape: {tuple(src_page.shape)} vs {tuple(dst_page.shape)}"
        )


def check_row_scatter(src: torch.Tensor, dst_loc: torch.Tensor, dst: torch.Tensor) -> None:
    """``scatter_rows``' operands: one dtype, row width and device; one destination row per source row."""
    _check_same_rows(src, dst, "row")
    if dst_loc.shape != src.shape[:1]:
        raise CpSharedKvError(
            f"dst_loc must have one entry per src row: src {tuple(src.shape)}, dst_loc {tuple(dst_loc.shape)}"
        )


def check_row_divides_page(current: torch.Tensor, dense: torch.Tensor) -> None:
    """A current row must tile a dense page exactly, or its rows would straddle pages."""
    row = current.shape[1:].numel() if current.dim() > 1 else 1
    page = dense.shape[1:].numel() if dense.dim() > 1 else 1
    if current.dim() < 2 or row == 0 or page % row:
        raise CpSharedKvError(
            f"current rows {tuple(current.shape)} do not tile the dense pages {tuple(dense.shape)}: "
            f"a page of {page} elements is not a whole number of {row}-element rows"
        )


def build_page_inverse(
    entry_pages: torch.Tensor,
    entry_req: torch.Tensor,
    num_requests: int,
    capacity: int,
    errors: torch.Tensor,
    entry_slots: torch.Tensor | None = None,
) -> PageInverse:
    """Per-request page inverse of a batch: every (request, page) entry of its page tables -> its dense slot.

    Args:
        entry_pages: int32 or int64 ``[E]``, the page id of each entry; ``-1``: no entry (the layout's rounding).
        entry_req: int64 ``[E]``, the request row of each entry (``-1`` with a ``-1`` page).
        num_requests: ``R``. capacity: ``C``, the number of page ids.
        errors: int32 ``[NUM_ERROR_KINDS]`` counter: page ids ``>= C`` or ``< -1``, a slot ``< 0`` of an entry
            that is not padding, and a page id held by two entries of one request (:data:`ERR_PAGE_OUT_OF_RANGE`);
            request ids outside ``[-1, R)`` (:data:`ERR_REQ_OUT_OF_RANGE`).
        entry_slots: int32 ``[E]``, the dense slot each entry points at: a request's own slot, or a shared history
            slot that several requests' entries point at (the contract's "shared history slot"). Default: entry
            ``e`` at slot ``e`` (every entry its own slot, the per-request layout).

    Returns:
        The canonical :class:`PageInverse` of :func:`inverse_table_size` ``(E)`` cells: every valid entry
        ``(entry_req[e], entry_pages[e])`` finds ``entry_slots[e]``; nothing else is found. Of two entries of one
        request holding one page, the first is found and the other is counted.
    """
    check_ids(entry_pages, "entry_pages")
    check_ids(entry_req, "entry_req")
    if entry_slots is None:
        entry_slots = default_slots(entry_pages)
    check_slots(entry_slots)
    if entry_pages.dim() != 1 or entry_req.shape != entry_pages.shape or entry_slots.shape != entry_pages.shape:
        raise CpSharedKvError(
            "entry_pages, entry_req and entry_slots must be 1-D of one length, got "
            f"{tuple(entry_pages.shape)}, {tuple(entry_req.shape)} and {tuple(entry_slots.shape)}"
        )
    if capacity < 1 or num_requests < 0:
        raise CpSharedKvError(f"capacity must be >= 1 and num_requests >= 0, got {capacity}, {num_requests}")
    page = entry_pages.to(torch.int64)
    req = entry_req.to(torch.int64)
    padding = (page == PADDING_ID) | (req == PADDING_ID)
    bad_page = ~padding & ((page >= capacity) | (page < PADDING_ID) | (entry_slots < 0))
    bad_req = ~padding & ~bad_page & ((req >= num_requests) | (req < PADDING_ID))
    errors[ERR_PAGE_OUT_OF_RANGE] += bad_page.sum().to(torch.int32)
    errors[ERR_REQ_OUT_OF_RANGE] += bad_req.sum().to(torch.int32)
    size = inverse_table_size(page.numel())
    entry = (~(padding | bad_page | bad_req)).nonzero().flatten()
    ordered, order = (req[entry] * capacity + page[entry]).sort(stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    errors[ERR_PAGE_OUT_OF_RANGE] += (~first).sum().to(torch.int32)
    distinct, owner = ordered[first], entry[order[first]]  # each key once, with its lowest entry
    cells = [EMPTY_KEY] * size
    placed = []
    for key, cell in zip(distinct.tolist(), hash_cells(distinct, size).tolist()):
        while cells[cell] != EMPTY_KEY:
            cell = (cell + 1) & (size - 1)
        cells[cell] = key
        placed.append(cell)
    keys = torch.tensor(cells, dtype=torch.int64, device=page.device)
    slots = torch.full((size,), PADDING_ID, dtype=torch.int32, device=page.device)
    slots[torch.tensor(placed, dtype=torch.int64, device=page.device)] = entry_slots[owner]
    return PageInverse(keys=keys, slots=slots, num_requests=num_requests, capacity=capacity)


def lookup_slots(inverse: PageInverse, req: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """int64, the shape of ``req``: the slot of each ``(req, page)`` in ``inverse``, -1 where absent.

    ``req`` in ``[0, R)`` and ``page`` in ``[0, C)``, int64 of one shape (the caller drops anything else)."""
    size = inverse.table_size
    query = (req * inverse.capacity + page).flatten()
    slot = torch.full_like(query, PADDING_ID)
    todo = torch.arange(query.numel(), device=query.device)
    cell = hash_cells(query, size)
    while todo.numel():  # probe each query's cells up to its key or an empty cell
        held = inverse.keys[cell]
        hit = held == query[todo]
        slot[todo[hit]] = inverse.slots[cell[hit]].to(torch.int64)
        going = ~hit & (held != EMPTY_KEY)
        todo, cell = todo[going], (cell[going] + 1) & (size - 1)
    return slot.reshape(req.shape)


def remap_locs(
    locs: torch.Tensor,
    req_id: torch.Tensor,
    inverse: PageInverse,
    page_size: int,
    errors: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map token locations of each request to locations in its dense view.

    ``loc`` of request ``r`` -> ``slot(r, loc // page_size) * page_size + loc % page_size``, the slot found in
    ``inverse`` (:func:`lookup_slots`).

    Args:
        locs: int32 or int64 ``[N]`` or ``[N, K]`` pool token locations; ``-1`` is padding, any other
            negative location is a bad id.
        req_id: int64 ``[N]``, the request row of each row of ``locs`` (``-1``: padding row).
        inverse: from :func:`build_page_inverse` (``R`` requests, capacity ``C``).
        page_size: tokens per page.
        errors: int32 counter: request ids outside ``[-1, R)``; locations below -1 and pages ``>= C``
            (:data:`ERR_PAGE_OUT_OF_RANGE`).
        out: where to write the result: a contiguous int32 tensor of the shape of ``locs``, on its device; ``locs``
            itself (int32, contiguous) remaps in place (each location is read before its own result is written, and
            by the one lane that writes it). None: a new tensor.

    Returns:
        int32, the shape of ``locs`` (``out`` when given): dense locations, ``-1`` for padding, a padding row, an
        absent page (not in the request's page table) or a dropped bad id.
    """
    check_ids(locs, "locs")
    check_ids(req_id, "req_id")
    check_inverse(inverse)
    check_remap_out(out, locs)
    rows, capacity = inverse.num_requests, inverse.capacity
    if locs.dim() == 1:
        loc2d = locs.reshape(-1, 1)
    else:
        loc2d = locs
    if req_id.shape != loc2d.shape[:1]:
        raise CpSharedKvError(
            f"req_id must have one id per row of locs: locs {tuple(locs.shape)}, req_id {tuple(req_id.shape)}"
        )
    loc = loc2d.to(torch.int64)
    req = req_id.to(torch.int64).reshape(-1, 1).expand_as(loc)
    page = torch.div(loc, page_size, rounding_mode="floor")

    padding = (loc == PADDING_ID) | (req == PADDING_ID)
    bad_req = ~padding & ((req < PADDING_ID) | (req >= rows))
    bad_page = ~padding & ~bad_req & ((loc < 0) | (page >= capacity))
    errors[ERR_REQ_OUT_OF_RANGE] += bad_req.sum().to(torch.int32)
    errors[ERR_PAGE_OUT_OF_RANGE] += bad_page.sum().to(torch.int32)

    ok = ~(padding | bad_req | bad_page)
    slot = torch.full_like(loc, PADDING_ID)
    slot[ok] = lookup_slots(inverse, req[ok], page[ok])
    dense = torch.where(slot >= 0, slot * page_size + loc % page_size, PADDING_ID)
    if out is not None:
        return out.copy_(dense.reshape(locs.shape))
    return dense.to(torch.int32).reshape(locs.shape)


def check_remap_out(out: torch.Tensor | None, locs: torch.Tensor) -> None:
    """``remap_locs``'s ``out``: a contiguous int32 tensor of ``locs``'s shape and device (never values)."""
    if out is None:
        return
    if out.dtype != torch.int32 or out.shape != locs.shape or out.device != locs.device or not out.is_contiguous():
        raise CpSharedKvError(
            f"remap_locs: out must be a contiguous int32 tensor of the shape of locs {tuple(locs.shape)} on "
            f"{locs.device}, got {out.dtype}{tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})"
        )


def check_current_locs(
    token_ends: torch.Tensor, dense_offsets: torch.Tensor, out_cache_loc: torch.Tensor, slot_pages: torch.Tensor
) -> None:
    """The operands of :func:`current_dense_locs`: dtypes and shapes (never values: that would synchronize)."""
    for t, name in ((token_ends, "token_ends"), (dense_offsets, "dense_offsets")):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise CpSharedKvError(f"{name} must be an int64 [R] tensor, got {t.dtype}{tuple(t.shape)}")
    if dense_offsets.shape != token_ends.shape or not token_ends.numel():
        raise CpSharedKvError(
            f"token_ends and dense_offsets must hold one value per request (R >= 1), got "
            f"{tuple(token_ends.shape)} and {tuple(dense_offsets.shape)}"
        )
    check_ids(out_cache_loc, "out_cache_loc")
    if out_cache_loc.dim() != 1:
        raise CpSharedKvError(f"out_cache_loc must be 1-D [N], got shape {tuple(out_cache_loc.shape)}")
    if slot_pages.dtype != torch.int32 or slot_pages.dim() != 1:
        raise CpSharedKvError(
            f"slot_pages must be an int32 [S] tensor, got {slot_pages.dtype}{tuple(slot_pages.shape)}"
        )


def current_dense_locs(
    token_ends: torch.Tensor,
    dense_offsets: torch.Tensor,
    out_cache_loc: torch.Tensor,
    slot_pages: torch.Tensor,
    page_size: int,
    errors: torch.Tensor,
) -> torch.Tensor:
    """Per batch: each current token's dense location, from its request and its place in the batch, and the check
    that its pool location is the one the dense layout puts there.

    Token ``t`` (of ``N = out_cache_loc.numel()``, request-major) belongs to request ``r``, the number of requests
    whose tokens end at or before it (``token_ends`` is nondecreasing, so a request without current tokens is never
    one); its dense location is ``d = dense_offsets[r] + t``. The location its pool row must have is
    ``slot_pages[d // page_size] * page_size + d % page_size`` (the page the layout put in that slot); a token whose
    ``out_cache_loc`` differs, or whose ``d`` is outside ``[0, S * page_size)`` or on a slot holding no page (-1),
    counts one :data:`~sglang_cpkv.ops.errors.ERR_CURRENT_LOC_MISMATCH` (its location is returned all the same: the
    dense view never depends on ``out_cache_loc``).

    Args:
        token_ends: int64 ``[R]``, ``cumsum(extend_lens)``: request ``r``'s current tokens are
            ``[token_ends[r - 1], token_ends[r])`` (``token_ends[-1] == N``).
        dense_offsets: int64 ``[R]``: request ``r``'s token ``t`` is at dense location ``dense_offsets[r] + t``.
        out_cache_loc: int32 or int64 ``[N]``, the current tokens' pool locations.
        slot_pages: int32 ``[S]``, the page id each dense slot holds (-1: none).
        page_size: tokens per page.
        errors: int32 counter (``ERR_CURRENT_LOC_MISMATCH``).

    Returns:
        int64 ``[N]``: the dense location of every current token (-1 for a token past ``token_ends[-1]``).
    """
    check_current_locs(token_ends, dense_offsets, out_cache_loc, slot_pages)
    if page_size < 1:
        raise CpSharedKvError(f"page_size must be >= 1, got {page_size}")
    device = out_cache_loc.device
    tokens = torch.arange(out_cache_loc.numel(), dtype=torch.int64, device=device)
    req = torch.searchsorted(token_ends, tokens, right=True)
    found = req < token_ends.numel()
    dense = torch.where(found, dense_offsets[req.clamp(max=token_ends.numel() - 1)] + tokens, PADDING_ID)
    slot = torch.div(dense, page_size, rounding_mode="floor")
    in_view = (dense >= 0) & (slot < slot_pages.numel())
    no_page = torch.full(
        (1,), PADDING_ID, dtype=torch.int64, device=device
    )  # at index S: what a location off the view reads
    page = torch.cat([slot_pages.to(torch.int64), no_page])[torch.where(in_view, slot, slot_pages.numel())]
    agrees = in_view & (page >= 0) & (page * page_size + dense % page_size == out_cache_loc.to(torch.int64))
    errors[ERR_CURRENT_LOC_MISMATCH] += (~agrees).sum().to(torch.int32)
    return dense


def copy_pages(
    src: torch.Tensor,
    src_page: torch.Tensor,
    dst: torch.Tensor,
    dst_page: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    """``dst[dst_page[i]] = src[src_page[i]]`` for every pair where both are >= 0.

    Args:
        src: ``[src_pages, page_elems]``: a paged tensor viewed one page per row (a pool of
            ``[tokens, row_bytes]`` uint8 is ``.view(-1, page_size * row_bytes)``).
        src_page: int32 ``[S]`` page rows of ``src``.
        dst: ``[dst_pages, page_elems]``, same dtype and row width as ``src``; written in place.
        dst_page: int32 ``[S]`` page rows of ``dst``. Duplicates: the winner is unspecified.
        errors: int32 counter: an index ``>=`` its tensor's page count or ``< -1``.
    """
    check_ids(src_page, "src_page")
    check_ids(dst_page, "dst_page")
    check_page_pairs(src, src_page, dst, dst_page)
    s = src_page.to(torch.int64)
    d = dst_page.to(torch.int64)
    bad = (s >= src.shape[0]) | (s < PADDING_ID) | (d >= dst.shape[0]) | (d < PADDING_ID)
    errors[ERR_PAGE_OUT_OF_RANGE] += bad.sum().to(torch.int32)
    ok = (s >= 0) & (d >= 0) & ~bad
    dst[d[ok]] = src[s[ok]]


def scatter_rows(src: torch.Tensor, dst_loc: torch.Tensor, dst: torch.Tensor, errors: torch.Tensor) -> None:
    """``dst[dst_loc[i]] = src[i]`` for every ``dst_loc[i] >= 0``.

    Args:
        src: ``[N, D]`` rows (current KV, all-gathered, in token order).
        dst_loc: int32 or int64 ``[N]`` destination rows (``-1``: skip).
        dst: ``[M, D]``, same dtype and width; written in place. Duplicates: winner unspecified.
        errors: int32 counter: a row ``>= M`` or ``< -1``.
    """
    check_ids(dst_loc, "dst_loc")
    check_row_scatter(src, dst_loc, dst)
    loc = dst_loc.to(torch.int64)
    bad = (loc >= dst.shape[0]) | (loc < PADDING_ID)
    errors[ERR_LOC_OUT_OF_RANGE] += bad.sum().to(torch.int32)
    ok = (loc >= 0) & ~bad
    dst[loc[ok]] = src[ok]


def materialize_and_fill(
    pool: torch.Tensor,
    src_page: torch.Tensor,
    dense: torch.Tensor,
    dst_page: torch.Tensor,
    current: torch.Tensor,
    dst_loc: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    """One layer's dense view: history pages, then current rows winning over them.

    Exactly ``copy_pages(pool, src_page, dense, dst_page, errors)`` followed by
    ``scatter_rows(current, dst_loc, dense.view(-1, *current.shape[1:]), errors)``: a current row
    landing in a copied page (the partial last history page, CURRENT_REUSE) overwrites it.

    Args:
        pool: ``[src_pages, page_elems]`` pages to copy from (a pool, or the all-gathered pages).
        src_page: int32 or int64 ``[S]`` page rows of ``pool`` (-1: skip).
        dense: ``[dense_pages, page_elems]``, contiguous, same dtype; written in place.
        dst_page: ``[S]``, same dtype as ``src_page``: the dense pages they go to.
        current: ``[N, D]`` current KV rows (``page_elems`` a multiple of ``D``), same dtype.
        dst_loc: int32 or int64 ``[N]`` rows of ``dense.view(-1, D)`` (-1: skip).
        errors: int32 counter (bad page rows, bad destination rows).
    """
    check_row_divides_page(current, dense)
    copy_pages(pool, src_page, dense, dst_page, errors)
    scatter_rows(current, dst_loc, dense.view(-1, *current.shape[1:]), errors)
