"""Torch reference of the CP shared-KV ops: the contract the Triton and CUDA kernels implement.

Terms are those of ``docs/design/cp-shared-kv-contract.md`` (copied from the project's shared
contract): page id, capacity ``C``, request row ``r`` in ``[0, R)``, page index ``j``, dense slot
``start[r] + j`` (the ragged dense layout: request ``r``'s slots follow those of the requests before
it), per-request inverse (:class:`PageInverse`: sized by the batch's entries, not by ``R * C``).

Five ops cover every hot path of the runtime:

* :func:`build_page_inverse` - per batch: every (request, page) entry's dense slot -> per-request inverse
  (each request's page ids sorted, with their slots: memory O(entries), found by binary search).
* :func:`remap_locs` - per batch (current locs) and per layer (top-k locs): token locations of a
  request -> dense locations, through the per-request inverse. Request ids are compact: one per
  row of ``locs`` (a ``[tokens, topk]`` tensor takes ``[tokens]`` ids), never broadcast.
* :func:`copy_pages` - per layer: whole pages from one paged tensor to another (history pool pages into
  dense slots: at cp 1 all of them, under CP this rank's owned block of the history region before the in-place
  all-gather; the region's pages into own slots that hold history rows).
* :func:`scatter_rows` - per layer: rows to destination rows (fill current KV into each
  request's dense slots, CURRENT_REUSE included; persist owned rows to the pool).
* :func:`materialize_and_fill` - per layer: :func:`copy_pages` then :func:`scatter_rows` into one
  dense view, as one op (the CUDA backend fuses the two launches).

Every op treats bad ids the same way (see :mod:`sglang_cpkv.ops.errors`): -1 (padding, absent)
is skipped silently; any other id outside its range is dropped and counted in ``errors``.
Copies are byte-exact, so the same op serves bf16 rows (1152 bytes) and the 656-byte packed FP8
DSA layout viewed as ``uint8``.

This module favours clarity over speed; it may synchronize (boolean-mask indexing) and is not
the GPU hot path - the dispatcher in :mod:`sglang_cpkv.ops` picks CUDA or Triton there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE, ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE, CpSharedKvError

PADDING_ID = -1


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


# What a batch's inverse holds per entry (its page and its slot, int32 each) and what its build allocates besides for
# the time of the build: the int64 keys, the sorted keys and the sort's int64 order (24 bytes), and the device
# sort's own double buffers of keys and order (at most 32 more). The reservation charges both per entry it admits.
INVERSE_BYTES_PER_ENTRY = 8
INVERSE_BUILD_BYTES_PER_ENTRY = 56


@dataclass(frozen=True, eq=False)
class PageInverse:
    """The per-request page inverse of a batch, sized by its entries (``E``) and requests (``R``), never by ``C``.

    Request ``r``'s page ids are ``pages[starts[r]:starts[r + 1]]``, ascending, with the dense slot of each at the
    same index of ``slots``; positions from ``starts[R]`` on hold the entries that are padding or bad ids (page
    -1). A lookup ``(r, page id)`` is a binary search of request ``r``'s run: the slot, or -1 when absent.

    Attributes:
        pages: int32 ``[E]``. slots: int32 ``[E]``. starts: int32 ``[R + 1]`` (``starts[0] == 0``).
        capacity: ``C``, the page ids a lookup may name (a larger one is a bad id).
    """

    pages: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor
    capacity: int

    @property
    def num_requests(self) -> int:
        return self.starts.numel() - 1

    @property
    def num_entries(self) -> int:
        return self.pages.numel()

    @property
    def device(self) -> torch.device:
        return self.pages.device

    @property
    def nbytes(self) -> int:
        """Device bytes the inverse holds for the life of its batch."""
        return sum(t.numel() * t.element_size() for t in (self.pages, self.slots, self.starts))

    def to(self, device: torch.device | str) -> PageInverse:
        return PageInverse(self.pages.to(device), self.slots.to(device), self.starts.to(device), capacity=self.capacity)

    @property
    def search_steps(self) -> int:
        """Halvings that bring any request's run to one entry (a kernel's fixed loop count): ``E.bit_length()``."""
        return self.num_entries.bit_length()


def check_inverse(inverse: PageInverse) -> None:
    """The inverse's three tensors agree in dtype, rank and device (host metadata only)."""
    if not isinstance(inverse, PageInverse):
        raise CpSharedKvError(f"inverse must be a PageInverse (from build_page_inverse), got {type(inverse).__name__}")
    if inverse.capacity < 1:
        raise CpSharedKvError(f"capacity must be >= 1, got {inverse.capacity}")
    parts = {"pages": inverse.pages, "slots": inverse.slots, "starts": inverse.starts}
    for name, t in parts.items():
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.device != inverse.device:
            raise CpSharedKvError(
                f"inverse.{name} must be a contiguous int32 1-D tensor on {inverse.device}, "
                f"got {t.dtype}{tuple(t.shape)} on {t.device}"
            )
    if inverse.slots.numel() != inverse.pages.numel() or inverse.starts.numel() < 1:
        raise CpSharedKvError(
            f"inverse must hold one slot per page and R + 1 starts, got pages {inverse.pages.numel()}, "
            f"slots {inverse.slots.numel()}, starts {inverse.starts.numel()}"
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
        :class:`PageInverse` of ``E`` entries: every valid entry ``(entry_req[e], entry_pages[e])`` finds
        ``entry_slots[e]``; nothing else is found. Of two entries of one request holding one page, one is found
        (unspecified which) and the other is counted.
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
    slot = entry_slots.to(torch.int64)
    padding = (page == PADDING_ID) | (req == PADDING_ID)
    bad_page = ~padding & ((page >= capacity) | (page < PADDING_ID) | (slot < 0))
    bad_req = ~padding & ~bad_page & ((req >= num_requests) | (req < PADDING_ID))
    valid = ~(padding | bad_page | bad_req)
    end = num_requests * capacity  # past every valid key: what is not an entry sorts last
    ordered, order = torch.where(valid, req * capacity + page, end).sort()
    held = ordered < end
    repeated = (held[1:] & (ordered[1:] == ordered[:-1])).sum()
    errors[ERR_PAGE_OUT_OF_RANGE] += (bad_page.sum() + repeated).to(torch.int32)
    errors[ERR_REQ_OUT_OF_RANGE] += bad_req.sum().to(torch.int32)
    boundaries = torch.arange(num_requests + 1, dtype=torch.int64, device=page.device) * capacity
    return PageInverse(
        pages=torch.where(held, ordered % capacity, PADDING_ID).to(torch.int32),
        slots=torch.where(held, slot[order], PADDING_ID).to(torch.int32),
        starts=torch.searchsorted(ordered, boundaries, out_int32=True),
        capacity=capacity,
    )


def lookup_slots(inverse: PageInverse, req: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """int64, the shape of ``req``: the slot of each ``(req, page)`` in ``inverse``, -1 where absent.

    ``req`` in ``[0, R)`` and ``page`` in ``[0, C)``, int64 of one shape (the caller drops anything else)."""
    starts = inverse.starts.to(torch.int64)
    num_entries, capacity = inverse.num_entries, inverse.capacity
    query = req * capacity + page
    if num_entries == 0:
        return torch.full_like(query, PADDING_ID)
    position = torch.arange(num_entries, dtype=torch.int64, device=starts.device)
    held = position < starts[-1]
    run = torch.searchsorted(starts[1:], position, right=True)  # the request whose run holds each position
    # Ascending: each request's run in request order, then what is no entry.
    keys = torch.where(held, run * capacity + inverse.pages.to(torch.int64), inverse.num_requests * capacity)
    found = torch.searchsorted(keys, query).clamp(max=num_entries - 1)
    return torch.where(keys[found] == query, inverse.slots.to(torch.int64)[found], PADDING_ID)


def remap_locs(
    locs: torch.Tensor,
    req_id: torch.Tensor,
    inverse: PageInverse,
    page_size: int,
    errors: torch.Tensor,
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

    Returns:
        int32, the shape of ``locs``: dense locations, ``-1`` for padding, a padding row, an
        absent page (not in the request's page table) or a dropped bad id.
    """
    check_ids(locs, "locs")
    check_ids(req_id, "req_id")
    check_inverse(inverse)
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
    return dense.to(torch.int32).reshape(locs.shape)


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
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise CpSharedKvError(
            f"src and dst must have one dtype and page width: src {src.dtype}{tuple(src.shape)}, dst {dst.dtype}{tuple(dst.shape)}"
        )
    if src_page.shape != dst_page.shape:
        raise CpSharedKvError(
            f"src_page and dst_page must have one shape: {tuple(src_page.shape)} vs {tuple(dst_page.shape)}"
        )
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
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise CpSharedKvError(
            f"src and dst must have one dtype and row width: src {src.dtype}{tuple(src.shape)}, dst {dst.dtype}{tuple(dst.shape)}"
        )
    if dst_loc.shape != src.shape[:1]:
        raise CpSharedKvError(
            f"dst_loc must have one entry per src row: src {tuple(src.shape)}, dst_loc {tuple(dst_loc.shape)}"
        )
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
