"""Triton :func:`build_page_inverse`: every (request, page) entry's dense slot -> per-request inverse.

Contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`. The keys are filled with
:data:`~sglang_cpkv.ops.reference.EMPTY_KEY` and the slots with a bound past every entry (torch), then three kernels:
every entry's key is inserted by compare-and-swap from its home cell (:func:`~sglang_cpkv.ops.reference.hash_cells`)
on, a smaller key displacing a larger one, which goes on probing (an ordered hash table: the cells do not depend on
the order of the swaps, so the table is the reference's canonical one); a key found already held is a page its
request holds twice (counted). Then every entry takes the minimum of its key's cell's slot and its own index, and
every cell turns that lowest entry into its slot (-1 when empty). Nothing synchronizes with the host; memory is the
table alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE
from sglang_cpkv.ops.reference import EMPTY_KEY, HASH_MULTIPLIER, PageInverse, implements, inverse_table_size
from sglang_cpkv.ops.reference import build_page_inverse as contract
from sglang_cpkv.ops.triton._common import check_errors, check_index, next_power_of_2

# GPU: 128 entries per program: a program's probe loop runs until its slowest lane is done, so smaller programs wait
# less (one H200, 8 x 2048 entries: 53 us at 128, 78 at 256, 96 at 64, 135 at 512, 189 at 1024; benchmark/results/
# 2026-12-03-h200-hash-inverse/triton_tiles.txt).
_GPU_BLOCK = 128
# Interpreter: each program instance costs ~1 ms, so one program for up to 64K entries.
_CPU_MAX_BLOCK = 1 << 16


@triton.jit
def home_cell(key, table_mask, MULTIPLIER: tl.constexpr):
    """The reference's ``hash_cells`` of int64 keys (``table_mask``: cells - 1)."""
    high = key >> 32
    mixed = (key - (high << 32)) * MULTIPLIER + high
    return (mixed ^ (mixed >> 32)) & table_mask


@triton.jit
def _entry_keys(entry_pages_ptr, entry_req_ptr, entry_slots_ptr, e, in_range, num_requests, capacity):
    """``(key, valid, bad_page, bad_req)`` of entries ``e`` (the reference's classification)."""
    page = tl.load(entry_pages_ptr + e, mask=in_range, other=-1).to(tl.int64)
    req = tl.load(entry_req_ptr + e, mask=in_range, other=-1).to(tl.int64)
    slot = tl.load(entry_slots_ptr + e, mask=in_range, other=-1)
    padding = (page == -1) | (req == -1)
    bad_page = in_range & ~padding & ((page >= capacity) | (page < -1) | (slot < 0))
    bad_req = in_range & ~padding & ~bad_page & ((req >= num_requests) | (req < -1))
    valid = in_range & ~padding & ~bad_page & ~bad_req
    return tl.where(valid, req * capacity + page, 0), valid, bad_page, bad_req


@triton.jit
def _insert_keys_kernel(
    entry_pages_ptr,  # int32/int64 [E]
    entry_req_ptr,  # int64 [E]
    entry_slots_ptr,  # int32 [E]
    keys_ptr,  # int64 [T], all EMPTY on entry
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    num_entries,  # E
    num_requests,  # R
    capacity,  # C
    table_mask,  # T - 1
    BLOCK: tl.constexpr,
    EMPTY: tl.constexpr,
    MULTIPLIER: tl.constexpr,
    ERR_PAGE: tl.constexpr,
    ERR_REQ: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key, pending, bad_page, bad_req = _entry_keys(
        entry_pages_ptr, entry_req_ptr, entry_slots_ptr, e, e < num_entries, num_requests, capacity
    )
    cell = home_cell(key, table_mask, MULTIPLIER)
    expect = tl.full((BLOCK,), EMPTY, tl.int64)  # what the lane believes its cell holds
    repeated = tl.zeros((BLOCK,), dtype=tl.int32)
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        # A lane that is done compares with a key no cell holds (EMPTY - 1), so its swap never writes.
        held = tl.atomic_cas(
            keys_ptr + cell, tl.where(pending, expect, EMPTY - 1), tl.where(pending, key, EMPTY - 1).to(tl.int64)
        )
        swapped = pending & (held == expect)
        # Into an empty cell: done. Over a larger key: that key goes on probing from the next cell.
        carry = swapped & (expect != EMPTY)
        repeat = pending & ~swapped & (held == key)
        larger = pending & ~swapped & (held > key)
        step = carry | (pending & ~swapped & (held != EMPTY) & (held < key))
        repeated += repeat.to(tl.int32)
        key = tl.where(carry, held, key)
        pending = pending & ~(swapped & ~carry) & ~repeat
        cell = tl.where(step, (cell + 1) & table_mask, cell)
        expect = tl.where(larger, held, EMPTY)
    n_bad_page = tl.sum(bad_page.to(tl.int32) + repeated, axis=0)
    n_bad_req = tl.sum(bad_req.to(tl.int32), axis=0)
    tl.atomic_add(errors_ptr + ERR_PAGE, n_bad_page, mask=n_bad_page > 0)
    tl.atomic_add(errors_ptr + ERR_REQ, n_bad_req, mask=n_bad_req > 0)


@triton.jit
def find_cells(keys_ptr, key, probing, table_mask, EMPTY: tl.constexpr, MULTIPLIER: tl.constexpr):
    """The cell of each probing lane's key, or -1 where it is absent."""
    cell = home_cell(key, table_mask, MULTIPLIER)
    found = tl.full(key.shape, -1, tl.int64)
    while tl.max(tl.ravel(probing.to(tl.int32)), axis=0) > 0:
        held = tl.load(keys_ptr + cell, mask=probing, other=EMPTY)
        hit = probing & (held == key)
        found = tl.where(hit, cell, found)
        probing = probing & ~hit & (held != EMPTY)
        cell = tl.where(probing, (cell + 1) & table_mask, cell)
    return found


@triton.jit
def _claim_cells_kernel(
    entry_pages_ptr,
    entry_req_ptr,
    entry_slots_ptr,
    keys_ptr,  # int64 [T], every key inserted
    owners_ptr,  # int32 [T]: the lowest entry of each cell's key, written
    num_entries,
    num_requests,
    capacity,
    table_mask,
    BLOCK: tl.constexpr,
    EMPTY: tl.constexpr,
    MULTIPLIER: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key, valid, _, _ = _entry_keys(
        entry_pages_ptr, entry_req_ptr, entry_slots_ptr, e, e < num_entries, num_requests, capacity
    )
    cell = find_cells(keys_ptr, key, valid, table_mask, EMPTY, MULTIPLIER)
    tl.atomic_min(owners_ptr + cell, e.to(tl.int32), mask=valid & (cell >= 0))


@triton.jit
def _owner_slots_kernel(
    keys_ptr,  # int64 [T]
    slots_ptr,  # int32 [T]: each held cell's lowest entry on entry, its slot (-1 when empty) on exit
    entry_slots_ptr,  # int32 [E]
    table_size,
    BLOCK: tl.constexpr,
    EMPTY: tl.constexpr,
):
    cell = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = cell < table_size
    held = in_range & (tl.load(keys_ptr + cell, mask=in_range, other=EMPTY) != EMPTY)
    owner = tl.load(slots_ptr + cell, mask=held, other=0)
    slot = tl.load(entry_slots_ptr + owner, mask=held, other=-1)
    tl.store(slots_ptr + cell, slot, mask=in_range)


@implements(contract)
def build_page_inverse(
    entry_pages, entry_req, num_requests, capacity, errors, entry_slots=None, *, block: int = 0, num_warps: int = 4
) -> PageInverse:
    """Per-request page inverse (contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`).

    Args:
        entry_pages: int32/int64 ``[E]``; entry_req: int64 ``[E]``; num_requests: ``R``; capacity: ``C``.
        errors: int32 ``[NUM_ERROR_KINDS]`` counter. entry_slots: int32 ``[E]`` (default: entry ``e`` at slot ``e``).
        block: entries per program (power of two). 0 = auto: 128 on a GPU, ``next_power_of_2(E)`` up to
            65536 on CPU (the interpreter).
        num_warps: warps per program.
    """
    device = entry_pages.device
    entry_pages = check_index("entry_pages", entry_pages, device)
    entry_req = check_index("entry_req", entry_req, device)
    if entry_slots is None:  # entry e at slot e
        if entry_pages.numel() > (1 << 31) - 1:
            raise ValueError(f"{entry_pages.numel()} entries do not fit int32 slots")
        entry_slots = torch.arange(entry_pages.numel(), dtype=torch.int32, device=device)
    entry_slots = check_index("entry_slots", entry_slots, device)
    if entry_slots.dtype != torch.int32:
        raise ValueError(f"entry_slots must be int32, got {entry_slots.dtype}")
    if entry_req.shape != entry_pages.shape or entry_slots.shape != entry_pages.shape:
        raise ValueError(
            "entry_pages, entry_req and entry_slots must be 1-D of one length, got "
            f"{tuple(entry_pages.shape)}, {tuple(entry_req.shape)} and {tuple(entry_slots.shape)}"
        )
    if capacity < 1 or num_requests < 0:
        raise ValueError(f"capacity must be >= 1 and num_requests >= 0, got {capacity}, {num_requests}")
    check_errors(errors, device)
    num_entries = entry_pages.numel()
    size = inverse_table_size(num_entries)
    keys = torch.full((size,), EMPTY_KEY, dtype=torch.int64, device=device)
    slots = torch.full((size,), max(num_entries, 1), dtype=torch.int32, device=device)  # past every entry
    on_cpu = device.type == "cpu"
    block = block or (min(next_power_of_2(max(num_entries, size)), _CPU_MAX_BLOCK) if on_cpu else _GPU_BLOCK)
    constants = {"BLOCK": block, "EMPTY": EMPTY_KEY, "MULTIPLIER": HASH_MULTIPLIER}
    entry_grid = (triton.cdiv(num_entries, block),)
    entries = (entry_pages, entry_req, entry_slots)
    sizes = (num_entries, num_requests, capacity, size - 1)
    if num_entries:
        _insert_keys_kernel[entry_grid](
            *entries,
            keys,
            errors,
            *sizes,
            **constants,
            ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
            ERR_REQ=ERR_REQ_OUT_OF_RANGE,
            num_warps=num_warps,
        )
        _claim_cells_kernel[entry_grid](*entries, keys, slots, *sizes, **constants, num_warps=num_warps)
    _owner_slots_kernel[(triton.cdiv(size, block),)](
        keys, slots, entry_slots, size, BLOCK=block, EMPTY=EMPTY_KEY, num_warps=num_warps
    )
    return PageInverse(keys=keys, slots=slots, num_requests=num_requests, capacity=capacity)
