"""Triton :func:`build_page_inverse`: every (request, page) entry's dense slot -> per-request inverse.

Contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`.

The table is filled with :data:`~sglang_cpkv.ops.reference.EMPTY_KEY` (torch), then one kernel inserts every entry
by compare-and-swap, probing from its home cell (:func:`~sglang_cpkv.ops.reference.hash_cells`) one cell at a time:
an empty cell it swaps its key into takes its slot; a cell already holding its key is a page its request holds twice
(counted). Nothing synchronizes with the host; memory is the table alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE
from sglang_cpkv.ops.reference import EMPTY_KEY, HASH_MULTIPLIER, PageInverse, inverse_table_size
from sglang_cpkv.ops.triton._common import check_errors, check_index, next_power_of_2

# GPU: 1024 entries per program (a 256K-token batch of 64-token pages is 4096 entries: 4 programs).
_GPU_BLOCK = 1024
# Interpreter: each program instance costs ~1 ms, so one program for up to 64K entries.
_CPU_MAX_BLOCK = 1 << 16


@triton.jit
def home_cell(key, table_mask, MULTIPLIER: tl.constexpr):
    """The reference's ``hash_cells`` of int64 keys (``table_mask``: cells - 1)."""
    high = key >> 32
    mixed = (key - (high << 32)) * MULTIPLIER + high
    return (mixed ^ (mixed >> 32)) & table_mask


@triton.jit
def _insert_entries_kernel(
    entry_pages_ptr,  # int32/int64 [E]
    entry_req_ptr,  # int64 [E]
    entry_slots_ptr,  # int32 [E]
    keys_ptr,  # int64 [T], all EMPTY_KEY on entry
    slots_ptr,  # int32 [T], written where an entry lands
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
    in_range = e < num_entries
    page = tl.load(entry_pages_ptr + e, mask=in_range, other=-1).to(tl.int64)
    req = tl.load(entry_req_ptr + e, mask=in_range, other=-1).to(tl.int64)
    slot = tl.load(entry_slots_ptr + e, mask=in_range, other=-1)
    padding = (page == -1) | (req == -1)
    bad_page = ~padding & ((page >= capacity) | (page < -1) | (slot < 0))
    bad_req = ~padding & ~bad_page & ((req >= num_requests) | (req < -1))
    pending = in_range & ~(padding | bad_page | bad_req)
    key = req * capacity + page
    cell = home_cell(tl.where(pending, key, 0), table_mask, MULTIPLIER)
    repeated = tl.zeros((BLOCK,), dtype=tl.int32)
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        # A lane that is done compares with a key no cell holds (EMPTY - 1), so its swap never writes.
        expect = tl.where(pending, EMPTY, EMPTY - 1).to(tl.int64)
        held = tl.atomic_cas(keys_ptr + cell, expect, tl.where(pending, key, EMPTY - 1).to(tl.int64))
        won = pending & (held == EMPTY)
        repeat = pending & (held == key)
        tl.store(slots_ptr + cell, slot, mask=won)
        repeated += repeat.to(tl.int32)
        pending = pending & ~won & ~repeat
        cell = tl.where(pending, (cell + 1) & table_mask, cell)
    n_bad_page = tl.sum((in_range & bad_page).to(tl.int32) + repeated, axis=0)
    n_bad_req = tl.sum((in_range & bad_req).to(tl.int32), axis=0)
    tl.atomic_add(errors_ptr + ERR_PAGE, n_bad_page, mask=n_bad_page > 0)
    tl.atomic_add(errors_ptr + ERR_REQ, n_bad_req, mask=n_bad_req > 0)


def build_page_inverse(
    entry_pages: torch.Tensor,
    entry_req: torch.Tensor,
    num_requests: int,
    capacity: int,
    errors: torch.Tensor,
    entry_slots: torch.Tensor | None = None,
    *,
    block: int = 0,
    num_warps: int = 4,
) -> PageInverse:
    """Per-request page inverse (contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`).

    Args:
        entry_pages: int32/int64 ``[E]``; entry_req: int64 ``[E]``; num_requests: ``R``; capacity: ``C``.
        errors: int32 ``[NUM_ERROR_KINDS]`` counter. entry_slots: int32 ``[E]`` (default: entry ``e`` at slot ``e``).
        block: entries per program (power of two). 0 = auto: 1024 on a GPU, ``next_power_of_2(E)`` up to
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
    slots = torch.empty(size, dtype=torch.int32, device=device)
    if num_entries:
        on_cpu = device.type == "cpu"
        block = block or (min(next_power_of_2(num_entries), _CPU_MAX_BLOCK) if on_cpu else _GPU_BLOCK)
        _insert_entries_kernel[(triton.cdiv(num_entries, block),)](
            entry_pages,
            entry_req,
            entry_slots,
            keys,
            slots,
            errors,
            num_entries,
            num_requests,
            capacity,
            size - 1,
            BLOCK=block,
            EMPTY=EMPTY_KEY,
            MULTIPLIER=HASH_MULTIPLIER,
            ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
            ERR_REQ=ERR_REQ_OUT_OF_RANGE,
            num_warps=num_warps,
        )
    return PageInverse(keys=keys, slots=slots, num_requests=num_requests, capacity=capacity)
