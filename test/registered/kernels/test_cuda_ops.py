"""CUDA CP shared-KV ops (sglang_cpkv.ops.cuda) == the torch reference, byte for byte, on a GPU.

Covers every op on random inputs over batch rows {1,2,3,4,8}, page sizes {16, 64}, bf16 1152-byte rows and
656-byte packed-FP8 rows (uint8), int32 and int64 indices, -1 padding and bad ids (counted, nothing written out
of range), row widths that are not 16-byte multiples and misaligned bases, the fused materialize+fill (current
rows win over the partial history page), the [[1,5],[9,5]] shared-page regression checked against the contract's
truth, torch.library.opcheck, a CUDA-graph capture + replay of the per-layer sequence (no host sync), and the
load/probe logic of ``is_available``. Skips without a GPU. The library comes from ``SGLANG_CPKV_CUDA_LIB`` (an AOT
build) or, in this test, a JIT build (``SGLANG_CPKV_CUDA_JIT`` defaults to 1 here; serving never compiles).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

from sglang_cpkv.ops import cuda_build, reference
from sglang_cpkv.ops.errors import (
    ERR_LOC_OUT_OF_RANGE,
    ERR_PAGE_OUT_OF_RANGE,
    ERR_REQ_OUT_OF_RANGE,
    CpSharedKvError,
    new_error_counter,
)
from sglang_cpkv.ops.reference import PageInverse
from sglang_cpkv.testing.batches import (
    ROW_LAYOUTS,
    assert_same_inverse,
    current_locs_case,
    error_counts,
    flat_slots,
    inverse_table,
)
from sglang_cpkv.testing.ci_register import register_cuda_ci

register_cuda_ci(est_time=120, stage="cpkv", runner_config="1-gpu")

os.environ.setdefault(cuda_build.JIT_ENV, "1")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

BATCH_ROWS = [1, 2, 3, 4, 8]
PAGE_SIZES = [16, 64]
INDEX_DTYPES = [torch.int32, torch.int64]
CAPACITY = 160  # pool pages of the random cases
DEVICE = "cuda"


@pytest.fixture(scope="module")
def cuda_ops():
    from sglang_cpkv.ops import cuda

    reason = cuda.unavailable_reason()
    if reason:
        pytest.fail(f"a GPU is visible but the CUDA ops are unavailable: {reason}")
    return cuda


def _gen(*key: object) -> torch.Generator:
    """A CPU generator seeded from the case's parameters (stable across processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _random_rows(rows: int, dtype: torch.dtype, width: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, width]`` of random bytes (never zeros: they would hide unwritten rows)."""
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=gen).view(dtype).to(DEVICE)


def _assert_same_bytes(have: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert have.shape == want.shape and have.dtype == want.dtype, (
        f"{what}: {have.dtype}{tuple(have.shape)} vs {want.dtype}{tuple(want.shape)}"
    )
    have_bytes, want_bytes = have.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    if not torch.equal(have_bytes, want_bytes):
        rows = (
            (have_bytes.reshape(have.shape[0], -1) != want_bytes.reshape(want.shape[0], -1))
            .any(dim=1)
            .nonzero()
            .flatten()
        )
        pytest.fail(f"{what}: {rows.numel()} rows differ, first {rows[:8].tolist()}")


def _page_table(
    rows: int, pages_per_request: int, capacity: int, gen: torch.Generator, dtype: torch.dtype, bad_ids: bool
) -> torch.Tensor:
    """Distinct pages per request (every request holds page capacity - 1: shared), -1 past each request's end;
    with ``bad_ids``, some entries are >= capacity or < -1."""
    table = torch.full((rows, pages_per_request), -1, dtype=torch.int64)
    for r in range(rows):
        held = int(torch.randint(1, pages_per_request + 1, (1,), generator=gen))
        table[r, 0] = capacity - 1
        table[r, 1:held] = torch.randperm(capacity - 1, generator=gen)[: held - 1]
        if bad_ids and r % 2 == 0:
            table[r, int(torch.randint(0, pages_per_request, (1,), generator=gen))] = capacity + r
            table[r, int(torch.randint(0, pages_per_request, (1,), generator=gen))] = -2 - r
    return table.to(dtype).to(DEVICE)


def _run(ops, name: str, *args, **kwargs) -> tuple[object, torch.Tensor]:
    """One op with a fresh counter: ``(output, errors)``; an inverse comes back read whole (``inverse_table``)."""
    errors = new_error_counter(DEVICE)
    out = getattr(ops, name)(*args, errors, **kwargs)
    return (inverse_table(out) if isinstance(out, PageInverse) else out), errors


@pytest.mark.parametrize("bad_ids", [False, True])
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("pages_per_request", [1, 9, 300])
@pytest.mark.parametrize("rows", BATCH_ROWS)
def test_build_page_inverse(cuda_ops, rows, pages_per_request, dtype, bad_ids):
    capacity = 6000 if pages_per_request == 300 else CAPACITY  # 6000: the inverse of a request spans several blocks
    table = _page_table(
        rows, pages_per_request, capacity, _gen("inverse", rows, pages_per_request, dtype, bad_ids), dtype, bad_ids
    )
    want, want_errors = _run(reference, "build_page_inverse", *flat_slots(table), rows, capacity)
    have, have_errors = _run(cuda_ops, "build_page_inverse", *flat_slots(table), rows, capacity)
    assert torch.equal(have, want)
    assert have_errors.tolist() == want_errors.tolist()
    assert bool(want_errors[ERR_PAGE_OUT_OF_RANGE] > 0) == bad_ids
    # The table itself: sized by the page-table entries, whatever C; every lookup as the reference's.
    compact = cuda_ops.build_page_inverse(*flat_slots(table), rows, capacity, new_error_counter(DEVICE))
    assert_same_inverse(
        reference.build_page_inverse(*flat_slots(table), rows, capacity, new_error_counter(DEVICE)),
        compact,
    )
    assert compact.nbytes == reference.inverse_bytes(table.numel()) <= 48 * table.numel()


def test_build_page_inverse_is_the_canonical_table_whatever_the_entry_order(cuda_ops):
    """Issue 33's B300 batch (1024 requests sharing 16 pages, a page of their own each: 17,408 keys in 65,536
    cells), its entries shuffled: thousands of threads insert concurrently and displace one another, and every
    order gives the reference's cells and slots, with one repeated page counted and its first entry's slot kept."""
    requests, shared = 1024, 16
    entry_req = torch.arange(requests).repeat_interleave(shared + 1)
    own = (shared + 8 + torch.arange(requests))[:, None]
    entry_pages = torch.cat([(8 + torch.arange(shared)).expand(requests, shared), own], dim=1).flatten()
    entry_slots = torch.arange(entry_pages.numel(), dtype=torch.int32)
    entry_pages[5] = entry_pages[3]  # request 0 holds page 11 twice
    want_errors = new_error_counter("cpu")
    want = reference.build_page_inverse(entry_pages, entry_req, requests, 307_488, want_errors, entry_slots)
    assert want_errors.tolist() == [1, 0, 0, 0]
    for seed in range(4):
        order = torch.randperm(entry_pages.numel(), generator=torch.Generator().manual_seed(seed))
        # The repeated page's first entry first, so "first" means the same entry in every order.
        order = torch.cat([torch.tensor([3]), order[order != 3]])
        errors = new_error_counter(DEVICE)
        have = cuda_ops.build_page_inverse(
            entry_pages[order].to(DEVICE),
            entry_req[order].to(DEVICE),
            requests,
            307_488,
            errors,
            entry_slots[order].to(DEVICE),
        )
        assert_same_inverse(want, have)
        assert errors.tolist() == [1, 0, 0, 0]


def test_build_page_inverse_repeated_pages_and_empty(cuda_ops):
    """A page twice in one request: counted, one of its slots kept; bad request ids counted; R = 0 and S = 0."""
    entry_pages = torch.tensor([3, 7, 3, 2, 3, -1, 5], dtype=torch.int32, device=DEVICE)
    entry_req = torch.tensor([0, 0, 0, 1, 1, -1, 4], dtype=torch.int64, device=DEVICE)
    entry_slots = torch.arange(7, dtype=torch.int32, device=DEVICE)
    want, want_errors = _run(reference, "build_page_inverse", entry_pages, entry_req, 2, 12, entry_slots=entry_slots)
    have, have_errors = _run(cuda_ops, "build_page_inverse", entry_pages, entry_req, 2, 12, entry_slots=entry_slots)
    assert have_errors.tolist() == want_errors.tolist() == [1, 1, 0, 0]
    assert int(have[3]) == 0 and int(have[12 + 3]) == 4  # the repeated page: its first entry's slot
    assert torch.equal(have, want)
    none = (
        torch.empty(0, dtype=torch.int32, device=DEVICE),
        torch.empty(0, dtype=torch.int64, device=DEVICE),
        torch.empty(0, dtype=torch.int32, device=DEVICE),
    )
    empty = cuda_ops.build_page_inverse(*none[:2], 0, CAPACITY, new_error_counter(DEVICE), none[2])
    assert (empty.table_size, empty.num_requests, empty.held_entries()) == (2, 0, 0)
    no_entries = cuda_ops.build_page_inverse(*none[:2], 2, CAPACITY, new_error_counter(DEVICE))
    assert no_entries.held_entries() == 0 and bool((inverse_table(no_entries) == -1).all())


def _shared_slot_entries(
    rows: int, own_per_request: int, num_shared: int, capacity: int, gen: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Entries of ``rows`` requests: each its own pages plus ``num_shared`` history pages every request holds, whose
    entries all point at one shared slot per page; slots a random permutation (not arange), entries in a random
    order (a shared slot's entries spread over blocks), one -1 rounding entry per request.

    Returns ``(entry_pages, entry_req, entry_slots, shared_pages, shared_slots)``."""
    perm = torch.randperm(capacity, generator=gen)
    shared_pages = perm[:num_shared]
    own = perm[num_shared:]
    num_slots = num_shared + rows * own_per_request
    slots = torch.randperm(num_slots, generator=gen)
    shared_slots, own_slots = slots[:num_shared], slots[num_shared:]
    pages, reqs, entry_slots = [], [], []
    for r in range(rows):
        # Each request's own pages: any pages but the shared ones (requests may hold the same own page id).
        mine = own[torch.randperm(own.numel(), generator=gen)[:own_per_request]]
        pages += [shared_pages, mine, torch.tensor([-1])]
        reqs += [torch.full((num_shared + own_per_request,), r), torch.tensor([-1])]
        entry_slots += [shared_slots, own_slots[r * own_per_request : (r + 1) * own_per_request], torch.tensor([-1])]
    order = torch.randperm(rows * (num_shared + own_per_request + 1), generator=gen)
    return (
        torch.cat(pages)[order].to(dtype).to(DEVICE),
        torch.cat(reqs)[order].to(torch.int64).to(DEVICE),
        torch.cat(entry_slots)[order].to(torch.int32).to(DEVICE),
        shared_pages.tolist(),
        shared_slots.tolist(),
    )


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("own_per_request, num_shared", [(4, 3), (300, 200)])  # 300 + 200: several blocks
@pytest.mark.parametrize("rows", [2, 3, 8])
def test_build_page_inverse_shared_and_permuted_slots(cuda_ops, rows, own_per_request, num_shared, dtype):
    """Entries of several requests point at one shared history slot; slots are a permutation, not arange."""
    capacity = 6000 if own_per_request == 300 else CAPACITY
    entry_pages, entry_req, entry_slots, shared_pages, shared_slots = _shared_slot_entries(
        rows, own_per_request, num_shared, capacity, _gen("shared slots", rows, own_per_request, dtype), dtype
    )
    valid_slots = entry_slots[entry_slots >= 0]
    assert not torch.equal(valid_slots.sort().values, valid_slots)
    want, want_errors = _run(
        reference, "build_page_inverse", entry_pages, entry_req, rows, capacity, entry_slots=entry_slots
    )
    have, have_errors = _run(
        cuda_ops, "build_page_inverse", entry_pages, entry_req, rows, capacity, entry_slots=entry_slots
    )
    _assert_same_bytes(have, want, "inverse")
    assert have_errors.tolist() == want_errors.tolist() == [0, 0, 0, 0]
    view = have.view(rows, capacity)
    for page, slot in zip(shared_pages[:8], shared_slots[:8]):
        assert view[:, page].tolist() == [slot] * rows  # every request's entry, one shared slot
    valid = entry_pages >= 0
    key = entry_req[valid] * capacity + entry_pages[valid].to(torch.int64)
    assert torch.equal(have[key], entry_slots[valid]) and int((have >= 0).sum()) == int(valid.sum())


def test_build_page_inverse_counts_negative_slots(cuda_ops):
    """A negative slot of an entry that is not padding: counted once in ERR_PAGE_OUT_OF_RANGE, its key stays -1;
    padding entries (page -1 or request -1) with negative slots are not counted."""
    entry_pages = torch.tensor([3, 7, 3, 8, -1, 6], dtype=torch.int32, device=DEVICE)
    entry_req = torch.tensor([0, 0, 1, 1, 1, -1], dtype=torch.int64, device=DEVICE)
    entry_slots = torch.tensor([-2, 5, 1, -1, -3, -1], dtype=torch.int32, device=DEVICE)
    want, want_errors = _run(reference, "build_page_inverse", entry_pages, entry_req, 2, 12, entry_slots=entry_slots)
    have, have_errors = _run(cuda_ops, "build_page_inverse", entry_pages, entry_req, 2, 12, entry_slots=entry_slots)
    expected = error_counts(page=2)
    assert have_errors.tolist() == want_errors.tolist() == expected
    _assert_same_bytes(have, want, "inverse")
    assert int(have[3]) == -1 and int(have[12 + 8]) == -1  # the bad entries' keys stay absent
    assert int(have[7]) == 5 and int(have[12 + 3]) == 1 and int((have >= 0).sum()) == 2


def test_build_page_inverse_refuses_int64_slots(cuda_ops, monkeypatch):
    """Slots are int32 by contract: the dispatcher refuses int64 (CpSharedKvError) before the CUDA op, which refuses
    them too (RuntimeError); nothing is counted."""
    from sglang_cpkv import ops

    monkeypatch.setenv(ops.BACKEND_ENV, "cuda")
    entry_pages = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    entry_req = torch.tensor([0, 0], dtype=torch.int64, device=DEVICE)
    entry_slots = torch.tensor([0, 1], dtype=torch.int64, device=DEVICE)
    errors = new_error_counter(DEVICE)
    with pytest.raises(CpSharedKvError, match=r"entry_slots must be int32, got torch\.int64"):
        ops.build_page_inverse(entry_pages, entry_req, 1, 4, errors, entry_slots)
    with pytest.raises(RuntimeError, match="entry_slots must be int32, got Long"):
        cuda_ops.build_page_inverse(entry_pages, entry_req, 1, 4, errors, entry_slots)
    with pytest.raises(RuntimeError, match=r"entry_slots must have one entry per entry_pages entry \(2\), got 1"):
        cuda_ops.build_page_inverse(entry_pages, entry_req, 1, 4, errors, entry_slots[:1].to(torch.int32))
    assert errors.tolist() == [0, 0, 0, 0]


def _locs_and_req(
    table: torch.Tensor,
    capacity: int,
    page_size: int,
    num_rows: int,
    row_len: int,
    gen: torch.Generator,
    loc_dtype: torch.dtype,
):
    """Per row a request (or -1 padding, or a bad id); per element a location of a page the request holds, of
    a page it does not hold, -1 (padding), another negative or a page >= capacity (bad)."""
    rows = table.shape[0]
    req = torch.randint(0, rows, (num_rows,), generator=gen)
    kind = torch.rand(num_rows, generator=gen)
    req[kind < 0.08] = -1
    req[(kind >= 0.08) & (kind < 0.12)] = rows + 3
    req[(kind >= 0.12) & (kind < 0.14)] = -4
    req[0], req[1] = rows + 3, 0  # at least one bad request id and (below) one bad page
    table_cpu = table.cpu().to(torch.int64)
    held = table_cpu[req.clamp(0, rows - 1)]  # [N, P]
    pick = torch.randint(0, table_cpu.shape[1], (num_rows, row_len), generator=gen)
    page = held.gather(1, pick)
    page = torch.where((page < 0) | (page >= capacity), torch.randint(0, capacity, page.shape, generator=gen), page)
    loc = page * page_size + torch.randint(0, page_size, page.shape, generator=gen)
    u = torch.rand(loc.shape, generator=gen)
    loc[u < 0.1] = torch.randint(0, capacity * page_size, loc.shape, generator=gen)[u < 0.1]  # mostly absent pages
    loc[(u >= 0.1) & (u < 0.15)] = -1
    loc[(u >= 0.15) & (u < 0.17)] = -9
    loc[(u >= 0.17) & (u < 0.2)] = capacity * page_size + 3
    loc[0], loc[1] = 0, capacity * page_size + 3  # whole rows, so that any column slice keeps them
    return loc.to(loc_dtype).to(DEVICE), req.to(DEVICE)


# name -> (K, columns of the allocated tensor, first column): K = 64 with an aligned base takes the 16-byte path
# (rows of 4 int32 / 2 int64 per access), the others the one-element path.
REMAP_SHAPES = {
    "1d": (1, 1, 0),
    "2d_k67": (67, 67, 0),
    "2d_k67_strided": (67, 72, 0),
    "2d_k64": (64, 64, 0),
    "2d_k64_strided": (64, 68, 0),
    "2d_k64_misaligned": (64, 68, 1),  # row stride allows 16 bytes, the base does not
}


@pytest.mark.parametrize("shape", list(REMAP_SHAPES))
@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("rows", BATCH_ROWS)
def test_remap_locs(cuda_ops, rows, page_size, loc_dtype, shape):
    gen = _gen("remap", rows, page_size, loc_dtype, shape)
    table = _page_table(rows, 12, CAPACITY, gen, torch.int32, bad_ids=False)
    inverse = reference.build_page_inverse(*flat_slots(table), table.shape[0], CAPACITY, new_error_counter(DEVICE))
    row_len, columns, first = REMAP_SHAPES[shape]
    locs, req = _locs_and_req(table, CAPACITY, page_size, 301, columns, gen, loc_dtype)
    locs = locs[:, first : first + row_len]
    if shape == "1d":
        locs = locs.reshape(-1)
    want, want_errors = _run(reference, "remap_locs", locs, req, inverse, page_size)
    have, have_errors = _run(cuda_ops, "remap_locs", locs, req, inverse, page_size)
    assert have.dtype == torch.int32 and have.shape == locs.shape
    assert torch.equal(have, want)
    assert have_errors.tolist() == want_errors.tolist()
    assert want_errors[ERR_REQ_OUT_OF_RANGE] > 0 and want_errors[ERR_PAGE_OUT_OF_RANGE] > 0


@pytest.mark.parametrize("rows", [1, 64])
def test_remap_locs_in_place(cuda_ops, rows):
    """``out=locs``: the DSA hook remaps upstream's own page table in place (each thread loads its locations before it
    stores their results); the same as out of place, and an ``out`` of another shape or dtype is refused."""
    gen = _gen("remap-in-place", rows)
    table = _page_table(rows, 12, CAPACITY, gen, torch.int32, bad_ids=False)
    inverse = reference.build_page_inverse(*flat_slots(table), table.shape[0], CAPACITY, new_error_counter(DEVICE))
    locs, req = _locs_and_req(table, CAPACITY, 64, 301, 2048, gen, torch.int32)
    want, want_errors = _run(reference, "remap_locs", locs, req, inverse, 64)
    errors = new_error_counter(DEVICE)
    have = locs.contiguous().clone()
    assert cuda_ops.remap_locs(have, req, inverse, 64, errors, out=have) is have
    assert torch.equal(have, want) and errors.tolist() == want_errors.tolist()
    with pytest.raises(RuntimeError, match="out must be"):
        cuda_ops.remap_locs(locs, req, inverse, 64, errors, out=locs.to(torch.int64))


def test_remap_locs_page_size_not_power_of_two(cuda_ops):
    gen = _gen("remap-ps", 48)
    table = _page_table(3, 12, CAPACITY, gen, torch.int64, bad_ids=False)
    inverse = reference.build_page_inverse(*flat_slots(table), table.shape[0], CAPACITY, new_error_counter(DEVICE))
    locs, req = _locs_and_req(table, CAPACITY, 48, 64, 33, gen, torch.int64)
    want, want_errors = _run(reference, "remap_locs", locs, req, inverse, 48)
    have, have_errors = _run(cuda_ops, "remap_locs", locs, req, inverse, 48)
    assert torch.equal(have, want) and have_errors.tolist() == want_errors.tolist()


@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("rows", BATCH_ROWS + [64])
def test_current_dense_locs(cuda_ops, rows, page_size, loc_dtype):
    """Requests of 0 to 1100 current tokens (zeros among them: no token reads their offset), more than one block of
    threads; about a tenth of the tokens carry another page's location."""
    gen = _gen("current", rows, page_size, loc_dtype)
    extend = tuple(int(n) if r % 3 != 1 else 0 for r, n in enumerate(torch.randint(1, 1100, (rows,), generator=gen)))
    case = current_locs_case(extend, page_size, 8 * sum(extend) // page_size + 64, gen)
    operands = case.operands(DEVICE, loc_dtype)
    want, want_errors = _run(reference, "current_dense_locs", *operands)
    have, have_errors = _run(cuda_ops, "current_dense_locs", *operands)
    assert have.dtype == torch.int64 and torch.equal(have, want) and have.tolist() == case.dense_locs
    assert have_errors.tolist() == want_errors.tolist() == error_counts(mismatch=case.disagreeing)


def _pairs(count: int, src_pages: int, dst_pages: int, gen: torch.Generator, dtype: torch.dtype, bad_ids: bool):
    """Page pairs with distinct destinations, -1 on either side, and (with ``bad_ids``) ids out of range."""
    src = torch.randint(0, src_pages, (count,), generator=gen)
    dst = torch.randperm(dst_pages, generator=gen)[:count]
    src[::7] = -1
    dst[3::11] = -1
    if bad_ids:
        src[1::13] = src_pages + 2
        dst[5::17] = dst_pages
        src[6::19] = -3
    return src.to(dtype).to(DEVICE), dst.to(dtype).to(DEVICE)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", list(ROW_LAYOUTS))
def test_copy_pages(cuda_ops, layout, page_size, dtype, strided):
    gen = _gen("copy", layout, page_size, dtype, strided)
    row_dtype, width = ROW_LAYOUTS[layout]
    pool = _random_rows(CAPACITY * (2 if strided else 1), row_dtype, page_size * width, gen)
    if strided:
        pool = pool[::2]  # page stride of two pages
    dense_pages = 90
    dst_init = _random_rows(dense_pages, row_dtype, page_size * width, gen)
    src_page, dst_page = _pairs(80, CAPACITY, dense_pages, gen, dtype, bad_ids=True)
    want = dst_init.clone()
    want_errors = new_error_counter(DEVICE)
    reference.copy_pages(pool, src_page, want, dst_page, want_errors)
    have = dst_init.clone()
    have_errors = new_error_counter(DEVICE)
    cuda_ops.copy_pages(pool, src_page, have, dst_page, have_errors)
    _assert_same_bytes(have, want, "dense pages")
    assert have_errors.tolist() == want_errors.tolist()
    assert have_errors[ERR_PAGE_OUT_OF_RANGE] > 0


@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("layout", list(ROW_LAYOUTS))
@pytest.mark.parametrize("rows", BATCH_ROWS)
def test_scatter_rows(cuda_ops, rows, layout, loc_dtype):
    gen = _gen("scatter", rows, layout, loc_dtype)
    row_dtype, width = ROW_LAYOUTS[layout]
    num_rows, dst_rows = 700 * rows, 900 * rows
    src = _random_rows(num_rows, row_dtype, width, gen)
    dst_init = _random_rows(dst_rows, row_dtype, width, gen)
    _, dst_loc = _pairs(num_rows, 1, dst_rows, gen, loc_dtype, bad_ids=False)
    dst_loc[2::23] = dst_rows + 1
    dst_loc[4::29] = -6
    want, have = dst_init.clone(), dst_init.clone()
    want_errors, have_errors = new_error_counter(DEVICE), new_error_counter(DEVICE)
    reference.scatter_rows(src, dst_loc, want, want_errors)
    cuda_ops.scatter_rows(src, dst_loc, have, have_errors)
    _assert_same_bytes(have, want, "dense rows")
    assert have_errors.tolist() == want_errors.tolist()
    assert have_errors[ERR_LOC_OUT_OF_RANGE] > 0


# Row widths that are not 16-byte multiples (narrower accesses) and bases off a 16-byte boundary.
@pytest.mark.parametrize(
    "row_dtype, width, byte_offset",
    [
        (torch.uint8, 13, 0),
        (torch.bfloat16, 3, 0),
        (torch.uint8, 100, 0),
        (torch.float32, 5, 0),
        (torch.uint8, 656, 1),
        (torch.bfloat16, 576, 2),
    ],
)
def test_odd_widths_and_misaligned_bases(cuda_ops, row_dtype, width, byte_offset):
    gen = _gen("odd", row_dtype, width, byte_offset)
    element = torch.empty((), dtype=row_dtype).element_size()
    shift = byte_offset // element

    def rows_at_offset(count: int, row_width: int) -> torch.Tensor:
        flat = _random_rows(1, row_dtype, count * row_width + shift, gen).reshape(-1)
        return flat[shift:].view(count, row_width)

    src = rows_at_offset(50, width)
    dst_init = rows_at_offset(70, width)
    _, dst_loc = _pairs(50, 1, 70, gen, torch.int64, bad_ids=False)
    want, have = dst_init.clone(), rows_at_offset(70, width)
    have.copy_(dst_init)
    reference.scatter_rows(src, dst_loc, want, new_error_counter(DEVICE))
    cuda_ops.scatter_rows(src, dst_loc, have, new_error_counter(DEVICE))
    _assert_same_bytes(have, want, "scatter_rows")
    pool = rows_at_offset(30, 4 * width)
    src_page, dst_page = _pairs(12, 30, 20, gen, torch.int32, bad_ids=True)
    dense_init = rows_at_offset(20, 4 * width)
    want, have = dense_init.clone(), rows_at_offset(20, 4 * width)
    have.copy_(dense_init)
    want_errors, have_errors = new_error_counter(DEVICE), new_error_counter(DEVICE)
    reference.copy_pages(pool, src_page, want, dst_page, want_errors)
    cuda_ops.copy_pages(pool, src_page, have, dst_page, have_errors)
    _assert_same_bytes(have, want, "copy_pages")
    assert have_errors.tolist() == want_errors.tolist()


def _layer_inputs(rows: int, page_size: int, layout: str, gen: torch.Generator, loc_dtype: torch.dtype):
    """A CURRENT_REUSE batch: request r has a history of h_r tokens (its last page partial) and c_r current
    tokens continuing that page in its dense view; src/dst pages copy its history pages to its dense slots."""
    row_dtype, width = ROW_LAYOUTS[layout]
    capacity = 400
    history = torch.randint(1, 6 * page_size, (rows,), generator=gen)
    current = torch.randint(1, 3 * page_size, (rows,), generator=gen)
    pages_per_request = int(((history + current + page_size - 1) // page_size).max())
    perm = torch.randperm(capacity, generator=gen)
    src_page, dst_page, dst_loc = [], [], []
    for r in range(rows):
        history_pages = int((history[r] + page_size - 1) // page_size)
        pages = perm[r * pages_per_request : r * pages_per_request + history_pages]
        src_page.append(pages)
        dst_page.append(torch.arange(history_pages) + r * pages_per_request)
        positions = torch.arange(int(history[r]), int(history[r] + current[r]))
        dst_loc.append((r * pages_per_request + positions // page_size) * page_size + positions % page_size)
    src_page = torch.cat(src_page).to(loc_dtype).to(DEVICE)
    dst_page = torch.cat(dst_page).to(loc_dtype).to(DEVICE)
    dst_loc = torch.cat(dst_loc).to(loc_dtype).to(DEVICE)
    dst_loc[::17] = -1
    pool = _random_rows(capacity, row_dtype, page_size * width, gen)
    cur = _random_rows(dst_loc.numel(), row_dtype, width, gen)
    dense = _random_rows(rows * pages_per_request, row_dtype, page_size * width, gen)
    return pool, src_page, dense, dst_page, cur, dst_loc


@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("layout", list(ROW_LAYOUTS))
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("rows", BATCH_ROWS)
def test_materialize_and_fill(cuda_ops, rows, page_size, layout, loc_dtype):
    for attempt in range(3):  # fresh data each time: an ordering race between copy and fill would show as a moving diff
        gen = _gen("fused", rows, page_size, layout, loc_dtype, attempt)
        pool, src_page, dense, dst_page, cur, dst_loc = _layer_inputs(rows, page_size, layout, gen, loc_dtype)
        want, want_errors = dense.clone(), new_error_counter(DEVICE)
        reference.copy_pages(pool, src_page, want, dst_page, want_errors)
        reference.scatter_rows(cur, dst_loc, want.view(-1, cur.shape[1]), want_errors)
        fused, fused_errors = dense.clone(), new_error_counter(DEVICE)
        cuda_ops.materialize_and_fill(pool, src_page, fused, dst_page, cur, dst_loc, fused_errors)
        _assert_same_bytes(fused, want, f"materialize_and_fill attempt {attempt}")
        assert fused_errors.tolist() == want_errors.tolist()


def test_materialize_and_fill_counts_bad_ids_and_skips_them(cuda_ops):
    gen = _gen("fused-bad")
    pool, src_page, dense, dst_page, cur, dst_loc = _layer_inputs(3, 16, "fp8_packed", gen, torch.int64)
    src_page[1] = pool.shape[0]
    dst_page[2] = -5
    dst_loc[3] = dense.numel() // cur.shape[1]
    want, want_errors = dense.clone(), new_error_counter(DEVICE)
    reference.copy_pages(pool, src_page, want, dst_page, want_errors)
    reference.scatter_rows(cur, dst_loc, want.view(-1, cur.shape[1]), want_errors)
    fused, fused_errors = dense.clone(), new_error_counter(DEVICE)
    cuda_ops.materialize_and_fill(pool, src_page, fused, dst_page, cur, dst_loc, fused_errors)
    _assert_same_bytes(fused, want, "materialize_and_fill with bad ids")
    assert fused_errors.tolist() == want_errors.tolist() == [2, 0, 1, 0]


@pytest.mark.parametrize("fused", [False, True])
def test_shared_page_regression(cuda_ops, fused):
    """[[1,5],[9,5]]: both requests hold page 5 (the seed fork's shared partial page); each request's current
    rows continue page 5 in its own dense view and must not reach the other's (the contract's truth)."""
    capacity, page_size, width = 12, 4, 8
    table = torch.tensor([[1, 5], [9, 5]], dtype=torch.int32, device=DEVICE)
    errors = new_error_counter(DEVICE)
    inverse = cuda_ops.build_page_inverse(*flat_slots(table), table.shape[0], capacity, errors)
    found = inverse_table(inverse)
    assert found[0 * capacity + 5].item() == 1 and found[1 * capacity + 5].item() == 3
    assert found[0 * capacity + 9].item() == -1 and found[1 * capacity + 1].item() == -1
    pool = torch.arange(capacity * page_size * width, dtype=torch.int32, device=DEVICE).view(capacity, -1)
    # History: 6 tokens each (pages X then 5 holding 2 tokens); current: pool locations 22, 23 (page 5, offsets
    # 2, 3) for both requests, with different KV.
    cur_locs = torch.tensor([22, 23, 22, 23], dtype=torch.int64, device=DEVICE)
    cur_req = torch.tensor([0, 0, 1, 1], dtype=torch.int64, device=DEVICE)
    dst_loc = cuda_ops.remap_locs(cur_locs, cur_req, inverse, page_size, errors)
    assert dst_loc.tolist() == [1 * page_size + 2, 1 * page_size + 3, 3 * page_size + 2, 3 * page_size + 3]
    current = -1 - torch.arange(4 * width, dtype=torch.int32, device=DEVICE).view(4, width)
    src_page = torch.tensor([1, 5, 9, 5], dtype=torch.int32, device=DEVICE)
    dst_page = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    dense = torch.full((4, page_size * width), 7, dtype=torch.int32, device=DEVICE)
    if fused:
        cuda_ops.materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors)
    else:
        cuda_ops.copy_pages(pool, src_page, dense, dst_page, errors)
        cuda_ops.scatter_rows(current, dst_loc, dense.view(-1, width), errors)
    assert errors.tolist() == [0, 0, 0, 0]
    rows = dense.view(-1, width)
    pool_rows = pool.view(-1, width)
    for r, pages in enumerate(([1, 5], [9, 5])):
        for p in range(6):  # history: the pool row of the request's own page table
            assert torch.equal(
                rows[(r * 2 + p // page_size) * page_size + p % page_size],
                pool_rows[pages[p // page_size] * page_size + p % page_size],
            )
        for k in range(2):  # current: the request's own current rows, never the other's
            assert torch.equal(rows[(r * 2 + 1) * page_size + 2 + k], current[2 * r + k])


def test_opcheck(cuda_ops):
    gen = _gen("opcheck")
    table = _page_table(3, 6, CAPACITY, gen, torch.int32, bad_ids=True)
    inverse = reference.build_page_inverse(*flat_slots(table), table.shape[0], CAPACITY, new_error_counter(DEVICE))
    locs, req = _locs_and_req(table, CAPACITY, 16, 9, 5, gen, torch.int32)
    pool, src_page, dense, dst_page, cur, dst_loc = _layer_inputs(2, 16, "bf16", gen, torch.int32)
    cases = {
        "build_page_inverse": (*flat_slots(table), 3, CAPACITY, new_error_counter(DEVICE)),
        "remap_locs": (
            locs,
            req,
            inverse.keys,
            inverse.slots,
            3,
            CAPACITY,
            16,
            new_error_counter(DEVICE),
        ),
        "current_dense_locs": (
            *current_locs_case((5, 0, 40), 16, CAPACITY, gen).operands(DEVICE),
            new_error_counter(DEVICE),
        ),
        "copy_pages": (pool, src_page, dense, dst_page, new_error_counter(DEVICE)),
        "scatter_rows": (cur, dst_loc, dense.view(-1, cur.shape[1]), new_error_counter(DEVICE)),
        "materialize_and_fill": (pool, src_page, dense, dst_page, cur, dst_loc, new_error_counter(DEVICE)),
    }
    for name, args in cases.items():
        torch.library.opcheck(getattr(torch.ops.sglang_cpkv, name).default, args)


def _unique_current_locs(table: torch.Tensor, per_request: int, page_size: int, gen: torch.Generator):
    """``per_request`` distinct pool locations of each request's own pages (so their dense rows are distinct)."""
    locs, req = [], []
    for r, row in enumerate(table.cpu().to(torch.int64)):
        held = row[row >= 0]
        tokens = (held[:, None] * page_size + torch.arange(page_size)).flatten()
        locs.append(tokens[torch.randperm(tokens.numel(), generator=gen)[:per_request]])
        req.append(torch.full((per_request,), r, dtype=torch.int64))
    return torch.cat(locs).to(DEVICE), torch.cat(req).to(DEVICE)


def test_torch_compile_fullgraph(cuda_ops):
    """The ops trace into one graph (fake implementations, declared mutations) and give the eager results."""
    capacity, page_size = 400, 16
    gen = _gen("compile")
    table = _page_table(3, 8, capacity, gen, torch.int32, bad_ids=True)
    top_locs, top_req = _locs_and_req(table, capacity, page_size, 40, 32, gen, torch.int32)
    pool, src_page, dense, dst_page, cur, dst_loc = _layer_inputs(3, page_size, "bf16", gen, torch.int64)

    def layer(errors, dense_out):
        inverse = cuda_ops.build_page_inverse(*flat_slots(table), table.shape[0], capacity, errors)
        top_dense = cuda_ops.remap_locs(top_locs, top_req, inverse, page_size, errors)
        cuda_ops.materialize_and_fill(pool, src_page, dense_out, dst_page, cur, dst_loc, errors)
        return inverse.keys, inverse.slots, top_dense

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    eager_errors, eager_dense = new_error_counter(DEVICE), dense.clone()
    compiled_errors, compiled_dense = new_error_counter(DEVICE), dense.clone()
    eager = layer(eager_errors, eager_dense)
    got = compiled(compiled_errors, compiled_dense)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    _assert_same_bytes(compiled_dense, eager_dense, "dense under torch.compile")
    assert compiled_errors.tolist() == eager_errors.tolist() and eager_errors.sum() > 0


def test_cuda_graph_capture_and_replay(cuda_ops):
    """The per-layer sequence captured in one CUDA graph (capture fails on any host sync), replayed on new data."""
    capacity, page_size, rows, topk = 400, 64, 4, 32
    gen = _gen("graph")
    table = _page_table(rows, 8, capacity, gen, torch.int32, bad_ids=False)
    pool, src_page, dense, dst_page, _, _ = _layer_inputs(rows, page_size, "fp8_packed", gen, torch.int32)
    cur_locs, cur_req = _unique_current_locs(table, 16, page_size, gen)
    cur = _random_rows(cur_locs.numel(), pool.dtype, pool.shape[1] // page_size, gen)
    dense = _random_rows(rows * 16, pool.dtype, pool.shape[1], gen)  # room for every slot of the [rows, 8] table
    top_locs, top_req = _locs_and_req(table, capacity, page_size, 64, topk, gen, torch.int32)
    static = [table, pool, src_page, dst_page, cur, cur_locs, cur_req, top_locs, top_req]
    errors = new_error_counter(DEVICE)
    dense_out = torch.empty_like(dense)

    def layer():
        errors.zero_()
        dense_out.copy_(dense)
        inverse = cuda_ops.build_page_inverse(*flat_slots(table), table.shape[0], capacity, errors)
        cur_dense = cuda_ops.remap_locs(cur_locs, cur_req, inverse, page_size, errors)
        top_dense = cuda_ops.remap_locs(top_locs, top_req, inverse, page_size, errors)
        cuda_ops.materialize_and_fill(pool, src_page, dense_out, dst_page, cur, cur_dense, errors)
        return inverse, cur_dense, top_dense

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layer()
    for replay in range(2):
        fresh_gen = _gen("graph-replay", replay)
        new_table = _page_table(rows, 8, capacity, fresh_gen, torch.int32, bad_ids=False)
        new_cur_locs, new_cur_req = _unique_current_locs(new_table, 16, page_size, fresh_gen)
        new_top_locs, new_top_req = _locs_and_req(new_table, capacity, page_size, 64, topk, fresh_gen, torch.int32)
        fresh = [
            new_table,
            _random_rows(pool.shape[0], pool.dtype, pool.shape[1], fresh_gen),
            src_page.flip(0),
            dst_page,
            _random_rows(cur.shape[0], cur.dtype, cur.shape[1], fresh_gen),
            new_cur_locs,
            new_cur_req,
            new_top_locs,
            new_top_req,
        ]
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        want_errors = new_error_counter(DEVICE)
        want_inverse = reference.build_page_inverse(*flat_slots(table), table.shape[0], capacity, want_errors)
        want_cur = reference.remap_locs(cur_locs, cur_req, want_inverse, page_size, want_errors)
        want_top = reference.remap_locs(top_locs, top_req, want_inverse, page_size, want_errors)
        want_dense = dense.clone()
        reference.copy_pages(pool, src_page, want_dense, dst_page, want_errors)
        reference.scatter_rows(cur, want_cur, want_dense.view(-1, cur.shape[1]), want_errors)
        assert_same_inverse(want_inverse, outputs[0])
        assert torch.equal(outputs[1], want_cur) and torch.equal(outputs[2], want_top)
        _assert_same_bytes(dense_out, want_dense, f"dense after replay {replay}")
        assert errors.tolist() == want_errors.tolist()


def _reason_in_fresh_process(env_updates: dict[str, str | None]) -> str:
    env = dict(os.environ)
    for key, value in env_updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    code = "from sglang_cpkv.ops import cuda; print(repr(cuda.unavailable_reason()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def _loaded_library_path() -> str:
    prebuilt = cuda_build.prebuilt_library()
    return str(prebuilt if prebuilt is not None else cuda_build.jit_library_path())


def test_probe_refuses_missing_stale_and_jit_off(cuda_ops, tmp_path):
    missing = _reason_in_fresh_process({cuda_build.LIB_ENV: str(tmp_path / "nowhere.so"), cuda_build.JIT_ENV: "0"})
    assert "does not exist" in missing
    jit_off = _reason_in_fresh_process({cuda_build.LIB_ENV: None, cuda_build.JIT_ENV: "0"})
    assert cuda_build.JIT_ENV in jit_off and "serving never compiles" in jit_off
    stale = tmp_path / f"{cuda_build.LIBRARY_NAME}.so"
    shutil.copyfile(_loaded_library_path(), stale)
    metadata = {"source_hash": "0" * 64, "torch_version": torch.__version__, "archs": ["90a"]}
    stale.with_suffix(".json").write_text(json.dumps(metadata))
    assert "stale" in _reason_in_fresh_process({cuda_build.LIB_ENV: str(stale), cuda_build.JIT_ENV: "0"})
    metadata["source_hash"] = cuda_build.source_hash()
    stale.with_suffix(".json").write_text(json.dumps(metadata))
    assert _reason_in_fresh_process({cuda_build.LIB_ENV: str(tmp_path), cuda_build.JIT_ENV: "0"}) == "None"


def _inverse_of(keys: int, slots: int, requests: int) -> PageInverse:
    """An inverse of the given sizes holding no page (for the argument checks)."""
    return PageInverse(
        keys=torch.full((keys,), -1, dtype=torch.int64, device=DEVICE),
        slots=torch.full((slots,), -1, dtype=torch.int32, device=DEVICE),
        num_requests=requests,
        capacity=12,
    )


# Last in the file: on the H200 run of 2026-11-30 the second case segfaulted the process (see torch_bindings.cc).
@pytest.mark.parametrize(
    "op, make_args, message",
    [
        (
            "remap_locs",
            lambda: (
                torch.zeros(4, 2, dtype=torch.int32, device=DEVICE),
                torch.zeros(4, dtype=torch.int32, device=DEVICE),
                _inverse_of(keys=32, slots=32, requests=2),
                4,
            ),
            "req_id must be int64, got Int",
        ),
        (
            "remap_locs",
            lambda: (
                torch.zeros(4, 2, dtype=torch.int32, device=DEVICE),
                torch.zeros(3, dtype=torch.int64, device=DEVICE),
                _inverse_of(keys=32, slots=32, requests=2),
                4,
            ),
            "req_id must have one id per row of locs",
        ),
        (
            "remap_locs",
            lambda: (
                torch.zeros(4, 2, dtype=torch.int32, device=DEVICE),
                torch.zeros(4, dtype=torch.int64, device=DEVICE),
                _inverse_of(keys=32, slots=31, requests=2),
                4,
            ),
            "inverse_slots must hold one slot per cell of inverse_keys (32), got 31",
        ),
        (
            "build_page_inverse",
            lambda: (
                torch.zeros(6, dtype=torch.float32, device=DEVICE),
                torch.zeros(6, dtype=torch.int64, device=DEVICE),
                2,
                12,
            ),
            "entry_pages must be int32 or int64, got Float",
        ),
        (
            "build_page_inverse",
            lambda: (
                torch.zeros(6, dtype=torch.int32),
                torch.zeros(6, dtype=torch.int64),
                2,
                12,
            ),
            "entry_pages must be a CUDA tensor",
        ),
        (
            "copy_pages",
            lambda: (
                torch.zeros(4, 8, device=DEVICE),
                torch.zeros(2, dtype=torch.int32, device=DEVICE),
                torch.zeros(4, 8, dtype=torch.float16, device=DEVICE),
                torch.zeros(2, dtype=torch.int32, device=DEVICE),
            ),
            "src and dst must have one dtype",
        ),
        (
            "copy_pages",
            lambda: (
                torch.zeros(4, 8, device=DEVICE),
                torch.zeros(2, dtype=torch.int32, device=DEVICE),
                torch.zeros(4, 8, device=DEVICE),
                torch.zeros(3, dtype=torch.int32, device=DEVICE),
            ),
            "dst_page must have one entry per src_page entry (2), got 3",
        ),
        (
            "scatter_rows",
            lambda: (
                torch.zeros(4, 8, device=DEVICE),
                torch.zeros(5, dtype=torch.int64, device=DEVICE),
                torch.zeros(6, 8, device=DEVICE),
            ),
            "dst_loc must have one entry per src row (4), got 5",
        ),
        (
            "scatter_rows",
            lambda: (
                torch.zeros(4, 8, device=DEVICE)[:, ::2],
                torch.zeros(4, dtype=torch.int64, device=DEVICE),
                torch.zeros(6, 4, device=DEVICE),
            ),
            "src must be contiguous after dim 0",
        ),
    ],
)
def test_checks_name_the_bad_argument(cuda_ops, op, make_args, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        getattr(cuda_ops, op)(*make_args(), new_error_counter(DEVICE))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
