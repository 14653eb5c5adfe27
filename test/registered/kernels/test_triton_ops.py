"""Triton CP shared-KV ops == the torch reference, byte for byte, on CPU (Triton interpreter).

Also the dispatcher of :mod:`sglang_cpkv.ops` (backend choice and ``SGLANG_CPKV_OPS_BACKEND``)
and a small subset of the GPU parity sweep (``test_ops_parity_sweep.py``): every op over two
batch sizes, both row layouts, ownership masks and a CP split.
"""

import os
import subprocess
import sys

# Triton chooses the interpreter when a kernel is defined: set it before sglang_cpkv.ops.triton.
os.environ["TRITON_INTERPRET"] = "1"

import inspect
import logging
from dataclasses import replace

import pytest
import torch

from sglang_cpkv import ops
from sglang_cpkv.ops import reference
from sglang_cpkv.ops import triton as triton_ops
from sglang_cpkv.ops.cuda import OP_NAMES
from sglang_cpkv.ops.errors import (
    CpSharedKvError,
    new_error_counter,
)
from sglang_cpkv.testing.batches import (
    ROW_LAYOUTS,
    assert_same_inverse,
    check_against_truth,
    current_locs,
    current_locs_case,
    error_counts,
    flat_slots,
    inverse_table,
    padded_page_table,
    random_rows,
    random_topk,
    run_case_on_ranks,
    same_bytes,
    sparse_case,
    topk_locs,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="cpkv-cpu")

INDEX_DTYPES = [torch.int32, torch.int64]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _both(op_name: str, *args, kwargs=None, **triton_knobs):
    """Run one op on the reference and on Triton with fresh counters: ``((ref_out, ref_err), (tri_out, tri_err))``;
    ``kwargs`` go to both, ``triton_knobs`` to Triton only. An inverse comes back read whole (``inverse_table``),
    after its table was checked equal cell by cell (both build the canonical table)."""
    results = []
    for impl, knobs in ((reference, {}), (triton_ops, triton_knobs)):
        errors = new_error_counter("cpu")
        results.append((getattr(impl, op_name)(*args, errors, **(kwargs or {}), **knobs), errors))
    if isinstance(results[0][0], ops.PageInverse):
        (ref, ref_err), (tri, tri_err) = results
        assert_same_inverse(ref, tri)
        results = [(inverse_table(ref), ref_err), (inverse_table(tri), tri_err)]
    return results


def test_kernels_run_in_the_interpreter():
    assert triton_ops.INTERPRETED, "TRITON_INTERPRET=1 was set before import, the kernels must be interpreted"
    assert ops.select_backend("cpu") == "triton"


# --- build_page_inverse ---------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("block", [0, 8])  # 0: auto (one program); 8: several programs
def test_build_page_inverse_matches_reference(index_dtype, block):
    case = sparse_case(3, 16, 40, 7, _gen(1), shared_pages=(5,))
    # the default slots: entry (r, j) at slot r * 9 + j
    (ref, ref_err), (tri, tri_err) = _both(
        "build_page_inverse", *flat_slots(padded_page_table(case, 9).to(index_dtype)), 3, 40, block=block
    )
    assert torch.equal(ref, tri), (ref.view(3, 40), tri.view(3, 40))
    assert torch.equal(ref_err, tri_err) and int(tri_err.sum()) == 0
    assert int((tri >= 0).sum()) == sum(len(t) for t in case.page_tables)


@pytest.mark.parametrize("block", [0, 4])
def test_build_page_inverse_counts_bad_ids_and_repeated_pages(block):
    # request 0: pages 3, 12 (>= C), 3 again (repeated); request 1: -7 (< -1), 2; a rounding slot; request 9 (>= R).
    entry_pages = torch.tensor([3, 12, 3, -7, 2, -1, 4], dtype=torch.int32)
    entry_req = torch.tensor([0, 0, 0, 1, 1, -1, 9])
    entry_slots = torch.arange(7, dtype=torch.int32)
    (ref, ref_err), (tri, tri_err) = _both(
        "build_page_inverse", entry_pages, entry_req, 2, 12, kwargs={"entry_slots": entry_slots}, block=block
    )
    expected = error_counts(page=3, req=1)  # pages 12, -7 and the second page 3 of request 0
    assert tri_err.tolist() == ref_err.tolist() == expected
    # The repeated page keeps its first entry's slot.
    assert torch.equal(ref, tri) and int(tri[3]) == 0 and tri[12 + 2] == 4 and int((tri >= 0).sum()) == 2


@pytest.mark.parametrize("block", [0, 8])
def test_the_table_does_not_depend_on_the_order_of_the_entries(block):
    """Entries shuffled (each with its slot; no page repeated) build the same cells: the table is canonical, so a
    batch's inverse is the same tensors whatever order the kernel's threads insert in. 300 keys in 512 cells of 16
    pages share home cells and displace one another."""
    gen = torch.Generator().manual_seed(7)
    entry_req = torch.arange(20).repeat_interleave(15)
    entry_pages = torch.cat([torch.randperm(40, generator=gen)[:15] for _ in range(20)]).to(torch.int32)
    entry_slots = torch.randperm(300, generator=gen).to(torch.int32)
    want = reference.build_page_inverse(entry_pages, entry_req, 20, 40, new_error_counter("cpu"), entry_slots)
    for seed in range(3):
        order = torch.randperm(300, generator=torch.Generator().manual_seed(seed))
        errors = new_error_counter("cpu")
        args = (entry_pages[order], entry_req[order], 20, 40, errors, entry_slots[order])
        assert_same_inverse(want, triton_ops.build_page_inverse(*args, block=block))
        assert_same_inverse(want, reference.build_page_inverse(*args))
        assert errors.tolist() == [0, 0, 0, 0]


def test_build_page_inverse_empty_batch():
    empty = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
    (ref, _), (tri, tri_err) = _both("build_page_inverse", *empty, 2, 12, kwargs={"entry_slots": empty[0]})
    assert torch.equal(ref, tri) and bool((tri == -1).all()) and int(tri_err.sum()) == 0


def _shared_slot_entries(index_dtype, num_requests, capacity, seed):
    """Entries of ``num_requests`` requests: each its own pages plus 3 history pages every request holds, whose
    entries all point at one shared slot per page; slots a random permutation (not arange), entries in a random
    order (a shared slot's entries spread over programs), one -1 rounding entry per request."""
    gen = _gen(seed)
    shared_pages = torch.randperm(capacity, generator=gen)[:3]
    pages, reqs = [], []
    own = torch.randperm(capacity, generator=gen)
    own = own[~torch.isin(own, shared_pages)]
    per_request = 4
    for r in range(num_requests):
        pages += shared_pages.tolist() + own[r * per_request : (r + 1) * per_request].tolist() + [-1]
        reqs += [r] * (len(shared_pages) + per_request) + [-1]
    num_slots = len(shared_pages) + num_requests * per_request
    slots = torch.randperm(num_slots, generator=gen)
    shared_slots = slots[: len(shared_pages)].tolist()
    own_slots = slots[len(shared_pages) :].tolist()
    entry_slots = []
    for r in range(num_requests):
        entry_slots += shared_slots + own_slots[r * per_request : (r + 1) * per_request] + [-1]
    order = torch.randperm(len(pages), generator=gen)
    return (
        torch.tensor(pages, dtype=index_dtype)[order],
        torch.tensor(reqs, dtype=torch.int64)[order],
        torch.tensor(entry_slots, dtype=torch.int32)[order],
        shared_pages.tolist(),
        shared_slots,
    )


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("num_requests", [2, 5])
@pytest.mark.parametrize("block", [0, 4])
def test_build_page_inverse_shared_slots_and_permuted_slots(index_dtype, num_requests, block):
    capacity = 40
    entry_pages, entry_req, entry_slots, shared_pages, shared_slots = _shared_slot_entries(
        index_dtype, num_requests, capacity, seed=10 + num_requests
    )
    assert not torch.equal(entry_slots[entry_slots >= 0].sort().values, entry_slots[entry_slots >= 0])
    (ref, ref_err), (tri, tri_err) = _both(
        "build_page_inverse",
        entry_pages,
        entry_req,
        num_requests,
        capacity,
        kwargs={"entry_slots": entry_slots},
        block=block,
    )
    assert same_bytes(ref, tri), (ref.view(num_requests, capacity), tri.view(num_requests, capacity))
    assert torch.equal(ref_err, tri_err) and int(tri_err.sum()) == 0
    view = tri.view(num_requests, capacity)
    for page, slot in zip(shared_pages, shared_slots):
        assert view[:, page].tolist() == [slot] * num_requests  # every request's entry, one shared slot
    valid = entry_pages >= 0
    key = entry_req[valid] * capacity + entry_pages[valid].to(torch.int64)
    assert torch.equal(tri[key], entry_slots[valid]) and int((tri >= 0).sum()) == int(valid.sum())


@pytest.mark.parametrize("block", [0, 4])
def test_build_page_inverse_counts_negative_slots(block):
    # request 0: page 3 slot -2 (bad), page 7 slot 5; request 1: page 3 slot 1, page 8 slot -1 (bad: not padding);
    # padding entries (page -1 or request -1) with negative slots are not counted.
    entry_pages = torch.tensor([3, 7, 3, 8, -1, 6], dtype=torch.int32)
    entry_req = torch.tensor([0, 0, 1, 1, 1, -1])
    entry_slots = torch.tensor([-2, 5, 1, -1, -3, -1], dtype=torch.int32)
    (ref, ref_err), (tri, tri_err) = _both(
        "build_page_inverse", entry_pages, entry_req, 2, 12, kwargs={"entry_slots": entry_slots}, block=block
    )
    expected = error_counts(page=2)
    assert tri_err.tolist() == ref_err.tolist() == expected
    assert same_bytes(ref, tri)
    assert int(tri[3]) == -1 and int(tri[12 + 8]) == -1  # the bad entries' keys stay absent
    assert int(tri[7]) == 5 and int(tri[12 + 3]) == 1 and int((tri >= 0).sum()) == 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_build_page_inverse_refuses_int64_slots(backend, monkeypatch):
    """Slots are int32 by contract: the dispatcher (any backend), the reference and the Triton wrapper refuse int64."""
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    entry_pages = torch.tensor([1, 2], dtype=torch.int32)
    entry_req = torch.tensor([0, 0])
    entry_slots = torch.tensor([0, 1], dtype=torch.int64)
    errors = new_error_counter("cpu")
    with pytest.raises(CpSharedKvError, match=r"entry_slots must be int32, got torch\.int64"):
        ops.build_page_inverse(entry_pages, entry_req, 1, 4, errors, entry_slots)
    with pytest.raises(CpSharedKvError, match=r"entry_slots must be int32, got torch\.int64"):
        reference.build_page_inverse(entry_pages, entry_req, 1, 4, errors, entry_slots)
    with pytest.raises(ValueError, match=r"entry_slots must be int32, got torch\.int64"):
        triton_ops.build_page_inverse(entry_pages, entry_req, 1, 4, errors, entry_slots)
    assert errors.tolist() == [0, 0, 0, 0]


# --- remap_locs -----------------------------------------------------------------------------


@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tiles", [(0, 0), (2, 4)])  # auto, or many small tiles with ragged edges
def test_remap_topk_locs_matches_reference(loc_dtype, page_size, tiles):
    gen = _gen(2)
    case = sparse_case(3, page_size, 30, 6, gen, shared_pages=(4,))
    inverse = reference.build_page_inverse(*flat_slots(padded_page_table(case, 6)), 3, 30, new_error_counter("cpu"))
    locs, req = topk_locs(case, 9, 13, gen)
    (ref, ref_err), (tri, tri_err) = _both(
        "remap_locs", locs.to(loc_dtype), req, inverse, page_size, block_n=tiles[0], block_k=tiles[1]
    )
    assert tri.dtype == torch.int32 and tri.shape == locs.shape
    assert torch.equal(ref, tri)
    assert torch.equal(ref_err, tri_err)
    assert (tri >= 0).any() and (tri == -1).any()  # the draw exercises both outcomes


def test_remap_counts_bad_request_and_page_ids():
    inverse = reference.build_page_inverse(
        *flat_slots(torch.tensor([[1, 5], [9, 5]], dtype=torch.int32)), 2, 12, new_error_counter("cpu")
    )
    # rows: request 0, padding row, request 7 (>= R), request -3 (< -1), request 1, request 0 again
    locs = torch.tensor(
        [[4, 48, -1], [4, 99, 7], [4, -1, 8], [21, -5, 36], [47, 50, 23], [-2, -1, -64]], dtype=torch.int32
    )
    req = torch.tensor([0, -1, 7, -3, 1, 0])
    (ref, ref_err), (tri, tri_err) = _both("remap_locs", locs, req, inverse, 4)
    assert torch.equal(ref, tri)
    # req: request 7's row, two locations (its -1 is padding); request -3's, three (-5 is no padding).
    # page: loc 48 (page 12) and loc 50 (page 12) with C = 12; locs -2 and -64 (only -1 is padding).
    expected = error_counts(req=5, page=4)
    assert tri_err.tolist() == ref_err.tolist() == expected
    assert tri[0].tolist() == [0, -1, -1] and tri[4].tolist() == [-1, -1, 15]  # page 11: not request 1's
    assert tri[5].tolist() == [-1, -1, -1]


@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
def test_remap_current_locs_1d(loc_dtype):
    case = sparse_case(4, 16, 50, 5, _gen(3))
    inverse = reference.build_page_inverse(*flat_slots(padded_page_table(case, 5)), 4, 50, new_error_counter("cpu"))
    locs, req = current_locs(case)
    (ref, ref_err), (tri, tri_err) = _both("remap_locs", locs.to(loc_dtype), req, inverse, 16)
    assert torch.equal(ref, tri) and torch.equal(ref_err, tri_err) and (tri >= 0).all()


@pytest.mark.parametrize("tiles", [(0, 0), (2, 4)])
def test_remap_in_place_equals_out_of_place(tiles):
    """``out=locs`` (the DSA hook's remap of upstream's own page table): each tile's locations are read before its
    results are written, so the in-place result is the out-of-place one; an ``out`` of another shape is refused."""
    gen = _gen(5)
    case = sparse_case(3, 16, 30, 6, gen, shared_pages=(4,))
    inverse = reference.build_page_inverse(*flat_slots(padded_page_table(case, 6)), 3, 30, new_error_counter("cpu"))
    locs, req = topk_locs(case, 9, 13, gen)
    locs = locs.to(torch.int32)
    for remap in (
        reference.remap_locs,
        lambda *a, **k: triton_ops.remap_locs(*a, **k, block_n=tiles[0], block_k=tiles[1]),
    ):
        expected = remap(locs, req, inverse, 16, new_error_counter("cpu"))
        table = locs.clone()
        assert remap(table, req, inverse, 16, new_error_counter("cpu"), out=table) is table
        assert torch.equal(table, expected)
    with pytest.raises(CpSharedKvError, match="out must be"):
        ops.remap_locs(locs, req, inverse, 16, new_error_counter("cpu"), out=torch.empty(3, dtype=torch.int32))


def test_remap_takes_compact_request_ids_only():
    inverse = reference.build_page_inverse(*flat_slots(torch.tensor([[1, 2]])), 1, 12, new_error_counter("cpu"))
    with pytest.raises(ValueError, match="one id per row"):
        triton_ops.remap_locs(
            torch.zeros(4, 3, dtype=torch.int32),
            torch.zeros(4, 3, dtype=torch.int64),
            inverse,
            4,
            new_error_counter("cpu"),
        )


# --- current_dense_locs ---------------------------------------------------------------------


@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("block", [0, 4])  # auto (one program), or many with a ragged last one
@pytest.mark.parametrize("extend_lens", [(7,), (5, 0, 9, 0, 1, 30), (0, 3), (4, 0)], ids=str)
def test_current_dense_locs_matches_reference_and_the_case(extend_lens, block, page_size, loc_dtype):
    case = current_locs_case(extend_lens, page_size, 64, _gen(sum(extend_lens) * page_size))
    (ref, ref_err), (tri, tri_err) = _both("current_dense_locs", *case.operands(loc_dtype=loc_dtype), block=block)
    assert tri.dtype == torch.int64 and torch.equal(ref, tri) and torch.equal(ref_err, tri_err)
    assert tri.tolist() == case.dense_locs
    assert tri_err.tolist() == error_counts(mismatch=case.disagreeing)


@pytest.mark.parametrize("impl", [reference, triton_ops], ids=["torch", "triton"])
def test_current_dense_locs_counts_every_disagreement(impl):
    """Requests of 2, 0 and 3 tokens over slots holding pages 5, 9 and none (page size 4): the second request's
    offset is never read; token 3 names page 7 instead of 9, token 4 lands on the slot that holds no page; a
    `token_ends` that stops short of the tokens leaves the last ones without a request (-1, counted)."""
    errors = new_error_counter("cpu")
    token_ends, offsets = torch.tensor([2, 2, 5]), torch.tensor([2, 1000, 4])
    slot_pages = torch.tensor([5, 9, -1], dtype=torch.int32)
    locs = torch.tensor([22, 23, 38, 31, 40], dtype=torch.int32)
    assert impl.current_dense_locs(token_ends, offsets, locs, slot_pages, 4, errors).tolist() == [2, 3, 6, 7, 8]
    assert errors.tolist() == error_counts(mismatch=2)
    short = impl.current_dense_locs(torch.tensor([2, 2, 3]), offsets, locs, slot_pages, 4, errors)
    assert short.tolist() == [2, 3, 6, -1, -1] and errors.tolist() == error_counts(mismatch=4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_current_dense_locs_refuses_bad_operands(backend, monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    errors = new_error_counter("cpu")
    ends, pages, locs = torch.tensor([2]), torch.tensor([3], dtype=torch.int32), torch.tensor([12, 13])
    for args, named in (
        ((ends.int(), ends, locs, pages, 4), r"token_ends must be an int64 \[R\] tensor, got torch\.int32"),
        ((ends, torch.tensor([0, 0]), locs, pages, 4), "one value per request"),
        ((ends[:0], ends[:0], locs, pages, 4), r"R >= 1"),
        ((ends, ends, locs.float(), pages, 4), "out_cache_loc must be int32 or int64"),
        ((ends, ends, locs, pages.long(), 4), r"slot_pages must be an int32 \[S\] tensor"),
        ((ends, ends, locs, pages, 0), "page_size must be >= 1"),
    ):
        with pytest.raises(CpSharedKvError, match=named):
            ops.current_dense_locs(*args, errors)
    assert errors.tolist() == error_counts()


# --- copy_pages / scatter_rows ---------------------------------------------------------------


def _guarded(rows: int, layout: str, gen: torch.Generator, page_size: int = 1):
    """A random destination of ``rows`` pages (or rows) inside a buffer with a guard row each side."""
    buffer = random_rows((rows + 2) * page_size, layout, gen).view(rows + 2, -1)
    return buffer, buffer[1:-1]


@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("block_words", [0, 64])
def test_copy_pages_byte_exact_and_bounded(layout, index_dtype, block_words):
    gen = _gen(4)
    page_size = 4
    src = random_rows(10 * page_size, layout, gen).view(10, -1)
    # -1 on either side skips; 10 (= src pages), 6 (= dst pages) and -2 are bad and dropped.
    src_page = torch.tensor([0, 9, 3, -1, 10, 2, 7, -2, 4, 3], dtype=index_dtype)
    dst_page = torch.tensor([5, 0, 2, 1, 3, -1, 6, 4, -3, 4], dtype=index_dtype)
    outs = []
    for impl, knobs in ((reference, {}), (triton_ops, {"block_words": block_words})):
        buffer, dst = _guarded(6, layout, _gen(5), page_size)
        before = buffer.clone()
        errors = new_error_counter("cpu")
        impl.copy_pages(src, src_page, dst, dst_page, errors, **knobs)
        assert same_bytes(buffer[0], before[0]) and same_bytes(buffer[-1], before[-1]), (
            "a bad page id wrote outside dst"
        )
        outs.append((buffer, errors))
    (ref, ref_err), (tri, tri_err) = outs
    assert same_bytes(ref, tri)
    assert tri_err.tolist() == ref_err.tolist() == [4, 0, 0, 0]
    assert same_bytes(tri[1 + 0], src[9]) and same_bytes(tri[1 + 4], src[3])


@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("block_rows", [0, 2])
def test_scatter_rows_byte_exact_and_bounded(layout, index_dtype, block_rows):
    gen = _gen(6)
    src = random_rows(9, layout, gen)
    dst_loc = torch.tensor([3, -1, 0, 11, 5, -4, 1, 12, 7], dtype=index_dtype)  # dst has 12 rows
    outs = []
    for impl, knobs in ((reference, {}), (triton_ops, {"block_rows": block_rows})):
        buffer, dst = _guarded(12, layout, _gen(7))
        before = buffer.clone()
        errors = new_error_counter("cpu")
        impl.scatter_rows(src, dst_loc, dst, errors, **knobs)
        assert same_bytes(buffer[0], before[0]) and same_bytes(buffer[-1], before[-1]), "a bad row wrote outside dst"
        outs.append((buffer, errors))
    (ref, ref_err), (tri, tri_err) = outs
    assert same_bytes(ref, tri)
    expected = error_counts(loc=2)  # 12 (= M) and -4
    assert tri_err.tolist() == ref_err.tolist() == expected
    assert same_bytes(tri[1 + 11], src[3])


@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
def test_materialize_and_fill_current_rows_win_over_copied_pages(layout):
    """The one-op dense view == copy_pages then scatter_rows; a current row in a copied page wins."""
    gen = _gen(9)
    page_size = 4
    pool = random_rows(8 * page_size, layout, gen).view(8, -1)
    current = random_rows(6, layout, gen)
    src_page = torch.tensor([3, 5, 9, 1], dtype=torch.int32)  # 9: bad pool page, dropped and counted
    dst_page = torch.tensor([0, 2, 1, 3], dtype=torch.int32)
    # Rows 1 and 2 land in dense page 0, which page 3 of the pool was copied into (CURRENT_REUSE);
    # row 4 is padding (-1); row 5 is beyond the 16 dense rows (dropped and counted).
    dst_loc = torch.tensor([13, 1, 2, 9, -1, 16], dtype=torch.int64)
    outs = []
    for impl in (reference, triton_ops, ops):
        buffer, dense = _guarded(4, layout, _gen(10), page_size)
        before = buffer.clone()
        errors = new_error_counter("cpu")
        impl.materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors)
        assert same_bytes(buffer[0], before[0]) and same_bytes(buffer[-1], before[-1]), "a bad id wrote outside dense"
        outs.append((dense, errors))
    rows = outs[0][0].view(16, -1)
    assert same_bytes(rows[1], current[1]) and same_bytes(rows[2], current[2]), (
        "current rows must win over the copied page"
    )
    assert same_bytes(rows[0], pool[3].view(page_size, -1)[0]) and same_bytes(rows[3], pool[3].view(page_size, -1)[3])
    for dense, errors in outs:
        assert same_bytes(dense, outs[0][0])
        assert errors.tolist() == [1, 0, 1, 0]


def test_scatter_rows_unaligned_view_falls_back_to_narrower_words():
    """A destination starting mid-word (odd byte offset) is still copied byte-exact."""
    gen = _gen(8)
    src = random_rows(3, "fp8_packed", gen)
    flat = random_rows(1, "fp8_packed", gen).view(-1).repeat(8)
    dst_ref = flat[1 : 1 + 7 * 656].view(7, 656).clone()
    dst_tri = flat.clone()[1 : 1 + 7 * 656].view(7, 656)
    loc = torch.tensor([6, 0, 2])
    reference.scatter_rows(src, loc, dst_ref, new_error_counter("cpu"))
    triton_ops.scatter_rows(src, loc, dst_tri, new_error_counter("cpu"))
    assert same_bytes(dst_ref, dst_tri)


@pytest.mark.parametrize("backend", [reference, triton_ops], ids=["torch", "triton"])
def test_every_backend_refuses_mismatched_operands_with_one_error(backend):
    ids = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(CpSharedKvError, match=r"src_page and dst_page must have one shape: \(2,\) vs \(3,\)"):
        backend.copy_pages(torch.zeros(4, 8), ids, torch.zeros(4, 8), torch.zeros(3, dtype=torch.int32), ids)
    with pytest.raises(CpSharedKvError, match="one dtype and page width"):
        backend.copy_pages(torch.zeros(4, 8), ids, torch.zeros(4, 8, dtype=torch.float16), ids, ids)
    with pytest.raises(CpSharedKvError, match=r"dst_loc must have one entry per src row"):
        backend.scatter_rows(torch.zeros(3, 8), ids, torch.zeros(4, 8), new_error_counter("cpu"))


def test_shape_and_dtype_errors_name_the_values():
    errors = new_error_counter("cpu")
    with pytest.raises(CpSharedKvError, match="one dtype and row width"):
        triton_ops.scatter_rows(
            torch.zeros(2, 8, dtype=torch.uint8),
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(4, 4, dtype=torch.uint8),
            errors,
        )
    with pytest.raises(ValueError, match="int32 or int64"):
        triton_ops.copy_pages(torch.zeros(2, 8), torch.zeros(1), torch.zeros(2, 8), torch.zeros(1), errors)
    with pytest.raises(ValueError, match="contiguous int32"):
        triton_ops.build_page_inverse(
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int64),
            1,
            4,
            torch.zeros(3, dtype=torch.int64),
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_contract_violations_refused_on_every_backend(backend, monkeypatch):
    """The dispatcher refuses, before any backend runs: float ids (1.7 would truncate to row 1), an inverse
    whose R * C does not match the caller's pair (a wrong C that divides it would move request 1's tokens
    into request 0's slots), and current rows that do not tile a dense page."""
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    errors = new_error_counter("cpu")
    rows = torch.zeros(4, 8)
    with pytest.raises(CpSharedKvError, match=r"dst_loc must be int32 or int64, got torch\.float32"):
        ops.scatter_rows(rows[:1], torch.tensor([1.7]), rows, errors)
    with pytest.raises(CpSharedKvError, match="entry_pages must be int32 or int64"):
        ops.build_page_inverse(torch.tensor([1.0]), torch.tensor([0]), 1, 4, errors)
    with pytest.raises(CpSharedKvError, match="entry_req must be int32 or int64"):
        ops.build_page_inverse(torch.tensor([1]), torch.tensor([0.0]), 1, 4, errors)
    with pytest.raises(CpSharedKvError, match=r"entry_slots must be int32, got torch\.int64"):
        ops.build_page_inverse(torch.tensor([1]), torch.tensor([0]), 1, 4, errors, torch.tensor([0]))
    inverse = ops.build_page_inverse(*flat_slots(torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)), 2, 6, errors)
    with pytest.raises(CpSharedKvError, match="inverse must be a PageInverse"):
        ops.remap_locs(torch.tensor([[4]]), torch.tensor([1]), torch.full((12,), -1, dtype=torch.int32), 2, errors)
    with pytest.raises(CpSharedKvError, match=r"inverse\.keys must be a contiguous torch\.int64 1-D tensor"):
        ops.remap_locs(torch.tensor([[4]]), torch.tensor([1]), replace(inverse, keys=inverse.keys.int()), 2, errors)
    with pytest.raises(CpSharedKvError, match="a power-of-two table"):
        ops.remap_locs(
            torch.tensor([[4]]),
            torch.tensor([1]),
            replace(inverse, keys=inverse.keys[:3], slots=inverse.slots[:3]),
            2,
            errors,
        )
    with pytest.raises(CpSharedKvError, match="page_size must be >= 1"):
        ops.remap_locs(torch.tensor([[4]]), torch.tensor([1]), inverse, 0, errors)
    pages = torch.zeros(2, 12)
    with pytest.raises(CpSharedKvError, match="do not tile the dense pages"):
        ops.materialize_and_fill(
            pages, torch.tensor([0]), pages, torch.tensor([1]), torch.zeros(1, 5), torch.tensor([0]), errors
        )
    assert errors.tolist() == [0, 0, 0, 0]


# --- the [[1,5],[9,5]] shared-page regression -------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shared_partial_page_keeps_each_request_its_own_rows(backend, monkeypatch):
    """Two requests hold page 5, partially filled, and both continue it with divergent current
    tokens (the seed fork's state class). Through the dispatcher, each request's dense view must
    hold its own history and its own current rows: with a 1-D inverse one request's current rows
    land in the other's slot."""
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    assert ops.select_backend("cpu") == backend
    page_size, capacity = 4, 12
    table = torch.tensor([[1, 5], [9, 5]], dtype=torch.int32)
    gen = _gen(9)
    pool = random_rows(capacity * page_size, "bf16", gen)
    errors = new_error_counter("cpu")
    inverse = ops.build_page_inverse(*flat_slots(table), 2, capacity, errors)
    dense = random_rows(4 * page_size, "bf16", gen)
    ops.copy_pages(
        pool.view(capacity, -1), table.view(-1), dense.view(4, -1), torch.arange(4, dtype=torch.int32), errors
    )
    # History: 6 tokens each (page 1 or 9, then 2 tokens of page 5); current: offsets 2, 3 of page 5.
    cur_locs = torch.tensor([22, 23, 22, 23], dtype=torch.int32)
    cur_req = torch.tensor([0, 0, 1, 1])
    current = random_rows(4, "bf16", gen)
    dense_locs = ops.remap_locs(cur_locs, cur_req, inverse, page_size, errors)
    assert dense_locs.tolist() == [6, 7, 14, 15]
    ops.scatter_rows(current, dense_locs, dense, errors)
    assert errors.tolist() == [0, 0, 0, 0]
    for r, first_page in enumerate((1, 9)):
        view = dense[r * 8 : r * 8 + 8]
        history = torch.cat([pool[first_page * 4 : first_page * 4 + 4], pool[20:22]])
        assert same_bytes(view[:6], history), f"request {r} lost its history"
        assert same_bytes(view[6:8], current[2 * r : 2 * r + 2]), f"request {r} holds another request's current rows"


# --- dispatcher --------------------------------------------------------------------------------


def test_every_backend_takes_the_operands_of_the_contract():
    """One typed signature per op (the reference's): the dispatcher's public op carries it, and every backend's function
    takes the same operands, names, order and defaults, or is refused when its module is imported."""
    for name in OP_NAMES:
        spec = getattr(reference, name)
        assert inspect.signature(getattr(ops, name)) == inspect.signature(spec)
        assert getattr(ops, name).__doc__ == spec.__doc__
    with pytest.raises(TypeError, match=r"takes \['src', 'dst_loc', 'errors'\], the contract's scatter_rows takes"):
        reference.implements(reference.scatter_rows)(lambda src, dst_loc, errors: None)
    with pytest.raises(TypeError, match="the contract's build_page_inverse"):  # a default dropped
        reference.implements(reference.build_page_inverse)(
            lambda entry_pages, entry_req, num_requests, capacity, errors, entry_slots: None
        )
    knobs = reference.implements(reference.copy_pages)(lambda src, src_page, dst, dst_page, errors, *, block=0: None)
    assert knobs.__name__ == "<lambda>"  # keyword-only tuning knobs may follow the operands


def test_forced_backend_setting(monkeypatch):
    for name in ("torch", "triton"):
        monkeypatch.setenv(ops.BACKEND_ENV, name)
        assert ops.select_backend("cpu") == name
    monkeypatch.setenv(ops.BACKEND_ENV, "cuda")
    with pytest.raises(RuntimeError, match=r"SGLANG_CPKV_OPS_BACKEND=cuda cannot run .* cpu tensors"):
        ops.build_page_inverse(
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 1, 4, new_error_counter("cpu")
        )
    monkeypatch.setenv(ops.BACKEND_ENV, "fastest")
    with pytest.raises(RuntimeError, match="must be one of auto, cuda, triton, torch, got 'fastest'"):
        ops.select_backend("cpu")


def test_forced_backend_is_the_one_that_runs(monkeypatch):
    """Told apart by behaviour: the Triton wrapper refuses a destination whose rows are strided
    (it writes rows as flat words), the reference writes it."""
    src, loc = torch.ones(2, 3), torch.tensor([1, 0])
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    dst = torch.zeros(2, 6)[:, ::2]
    ops.scatter_rows(src, loc, dst, new_error_counter("cpu"))
    assert torch.equal(dst, src)
    for name in ("triton", "auto"):
        monkeypatch.setenv(ops.BACKEND_ENV, name)
        with pytest.raises(ValueError, match="dst rows must be contiguous"):
            ops.scatter_rows(src, loc, torch.zeros(2, 6)[:, ::2], new_error_counter("cpu"))


def test_backend_choice_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_logged_backends", set())
    monkeypatch.setenv(ops.BACKEND_ENV, "auto")
    with caplog.at_level(logging.INFO, logger="sglang_cpkv.ops"):
        for _ in range(3):
            ops.select_backend("cpu")
    assert [r.getMessage() for r in caplog.records] == [
        "CP shared-KV ops run on the triton backend (SGLANG_CPKV_OPS_BACKEND=auto, cpu tensors)"
    ]


def test_without_interpreter_cpu_ops_use_torch():
    code = (
        "import os, torch; from sglang_cpkv import ops\n"
        "assert ops.select_backend('cpu') == 'torch', ops.select_backend('cpu')\n"
        "os.environ['SGLANG_CPKV_OPS_BACKEND'] = 'triton'\n"
        "try:\n    ops.select_backend('cpu')\nexcept RuntimeError as e:\n    print(e)\nelse:\n    raise SystemExit('forced triton ran without the interpreter')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", ops.BACKEND_ENV)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "only under its interpreter" in proc.stdout


# --- CPU subset of the parity sweep ----------------------------------------------------------


@pytest.mark.parametrize("layer_ahead", [False, True])
@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
def test_sweep_subset_pipeline(layout, layer_ahead, monkeypatch):
    """The runtime's layer pipeline at cp 2 (owned-page exchange, CP-split fill with padding, top-k remap)
    on sparse batches sharing a page: every rank's results are byte-equal on Triton and torch, and equal
    the brute-force truth."""
    width = ROW_LAYOUTS[layout][1]
    base = sparse_case(3, 16, 64, 4, _gen(100 + width), shared_pages=(7,))
    case = base.on_cp(2)
    pool, current = random_rows(64 * 16, layout, _gen(1)), random_rows(case.num_tokens, layout, _gen(2))
    topk, positions = random_topk(case, 6, seed=width)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(ops.BACKEND_ENV, backend)
        runs[backend] = run_case_on_ranks(case, pool, current, topk, layer_ahead=layer_ahead)
        assert check_against_truth(case, pool, current, positions, runs[backend]) == [], backend
    locs = case.out_cache_loc()
    # A location two requests write (independent draws may collide) has an unspecified winner in the pool.
    fields = ("dense", "remapped", "current_full") + (("pool_after",) if len(set(locs)) == len(locs) else ())
    for ref, tri in zip(runs["torch"], runs["triton"]):
        for field in fields:
            assert same_bytes(getattr(ref, field), getattr(tri, field)), field


def test_the_interpreters_overflow_checks_are_dropped_so_the_kit_skips_them():
    """On CPU the kit turns off the interpreter's integer-overflow checks (dsa_kit._skip_dropped_overflow_checks)
    because the interpreter computes them and drops them: an int32 add that overflows stores its wrapped value with
    the checks on, and the same with them off. Should Triton start enforcing them, the first assert fails."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from sglang_cpkv.testing.dsa_kit import _skip_dropped_overflow_checks

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr):
        i = tl.arange(0, 4)
        tl.store(out_ptr + i, tl.load(x_ptr + i) + tl.load(y_ptr + i))

    x = torch.full((4,), 2**31 - 1, dtype=torch.int32)
    y = torch.tensor([0, 1, 2, -5], dtype=torch.int32)
    wrapped = (x.to(torch.int64) + y).to(torch.int32)  # two's complement, as the GPU computes it
    saved = interpreter.interpreter_builder.options
    try:
        assert saved.sanitize_overflow and not saved.debug
        checked = torch.empty_like(x)
        add[(1,)](x, y, checked)
        _skip_dropped_overflow_checks()
        assert not interpreter.interpreter_builder.options.sanitize_overflow
        unchecked = torch.empty_like(x)
        add[(1,)](x, y, unchecked)
    finally:
        interpreter.interpreter_builder.options = saved
    assert torch.equal(checked, wrapped) and torch.equal(unchecked, wrapped)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
