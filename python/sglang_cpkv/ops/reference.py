"""Torch reference of the CP shared-KV ops: the contract the Triton and CUDA kernels implement.

Terms are those of ``docs/design/cp-shared-kv-contract.md`` (copied from the project's shared
contract): page id, capacity ``C``, request row ``r`` in ``[0, R)``, page index ``j`` in
``[0, P)``, dense slot ``r * P + j``, per-request inverse (int32, flat ``[R * C]``, entry
``r * C + page_id`` = slot or -1).

Four ops cover every hot path of the runtime:

* :func:`build_page_inverse` - per batch: page table -> per-request inverse.
* :func:`remap_locs` - per batch (current locs) and per layer (top-k locs): token locations of a
  request -> dense locations, through the per-request inverse. Request ids are compact: one per
  row of ``locs`` (a ``[tokens, topk]`` tensor takes ``[tokens]`` ids), never broadcast.
* :func:`copy_pages` - per layer: whole pages from one paged tensor to another (materialize
  history pool pages into dense slots; pack/unpack owned pages around the CP all-gather).
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

import torch

from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE, ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE

PADDING_ID = -1


def build_page_inverse(page_table: torch.Tensor, capacity: int, errors: torch.Tensor) -> torch.Tensor:
    """Per-request page inverse of a batch.

    Args:
        page_table: int32 ``[R, P]``; row ``r`` lists request ``r``'s page ids in page-index
            order, ``-1`` past its last page. The request id of slot ``s`` is ``s // P``.
        capacity: ``C``, the number of page ids of the pool.
        errors: int32 ``[NUM_ERROR_KINDS]`` counter (page ids ``>= C`` or ``< -1``).

    Returns:
        int32 ``[R * C]``: entry ``r * C + page_table[r, j]`` = ``r * P + j``; -1 elsewhere.
        A page id twice in one row is an error of the caller (checked mode reports it); which
        slot wins is then unspecified.
    """
    rows, pages_per_request = page_table.shape
    inverse = torch.full((rows * capacity,), PADDING_ID, dtype=torch.int32, device=page_table.device)
    flat = page_table.reshape(-1).to(torch.int64)
    slot = torch.arange(flat.numel(), device=page_table.device, dtype=torch.int64)
    req = slot // pages_per_request
    bad = (flat >= capacity) | (flat < PADDING_ID)
    errors[ERR_PAGE_OUT_OF_RANGE] += bad.sum().to(torch.int32)
    valid = (flat >= 0) & (flat < capacity)
    inverse[req[valid] * capacity + flat[valid]] = slot[valid].to(torch.int32)
    return inverse


def remap_locs(
    locs: torch.Tensor,
    req_id: torch.Tensor,
    inverse: torch.Tensor,
    capacity: int,
    page_size: int,
    errors: torch.Tensor,
) -> torch.Tensor:
    """Map token locations of each request to locations in its dense view.

    ``loc`` of request ``r`` -> ``inverse[r * C + loc // page_size] * page_size + loc % page_size``.

    Args:
        locs: int32 or int64 ``[N]`` or ``[N, K]`` pool token locations; ``-1`` is padding.
        req_id: int64 ``[N]``, the request row of each row of ``locs`` (``-1``: padding row).
        inverse: int32 ``[R * C]`` from :func:`build_page_inverse`.
        capacity: ``C``. ``R`` is ``inverse.numel() // C``.
        page_size: tokens per page.
        errors: int32 counter: request ids outside ``[-1, R)``, pages outside ``[0, C)``.

    Returns:
        int32, the shape of ``locs``: dense locations, ``-1`` for padding, a padding row, an
        absent page (not in the request's page table) or a dropped bad id.
    """
    rows = inverse.numel() // capacity
    if locs.dim() == 1:
        loc2d = locs.reshape(-1, 1)
    else:
        loc2d = locs
    if req_id.shape != loc2d.shape[:1]:
        raise ValueError(
            f"req_id must have one id per row of locs: locs {tuple(locs.shape)}, req_id {tuple(req_id.shape)}"
        )
    loc = loc2d.to(torch.int64)
    req = req_id.to(torch.int64).reshape(-1, 1).expand_as(loc)
    page = torch.div(loc, page_size, rounding_mode="floor")

    padding = (loc < 0) | (req == PADDING_ID)
    bad_req = ~padding & ((req < PADDING_ID) | (req >= rows))
    bad_page = ~padding & ~bad_req & (page >= capacity)
    errors[ERR_REQ_OUT_OF_RANGE] += bad_req.sum().to(torch.int32)
    errors[ERR_PAGE_OUT_OF_RANGE] += bad_page.sum().to(torch.int32)

    ok = ~(padding | bad_req | bad_page)
    slot = torch.full_like(loc, PADDING_ID)
    slot[ok] = inverse[req[ok] * capacity + page[ok]].to(torch.int64)
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
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"src and dst must have one dtype and page width: src {src.dtype}{tuple(src.shape)}, dst {dst.dtype}{tuple(dst.shape)}"
        )
    if src_page.shape != dst_page.shape:
        raise ValueError(
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
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"src and dst must have one dtype and row width: src {src.dtype}{tuple(src.shape)}, dst {dst.dtype}{tuple(dst.shape)}"
        )
    if dst_loc.shape != src.shape[:1]:
        raise ValueError(
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
    copy_pages(pool, src_page, dense, dst_page, errors)
    scatter_rows(current, dst_loc, dense.view(-1, *current.shape[1:]), errors)
