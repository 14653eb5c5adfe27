"""Triton :func:`build_page_inverse`: every (request, page) entry's dense slot -> per-request inverse.

Contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`.

Three steps, none of which synchronizes: a kernel checks every entry and writes its sort key (``r * C + page``
for an entry, ``R * C`` for padding and bad ids, so they sort last) counting bad ids; torch's device sort orders
the keys; a second kernel writes each sorted position's page id and slot (the slot through the sort's order) and
counts a key equal to its predecessor (a page twice in one request). Each request's run starts where the sorted
keys reach ``r * C`` (``torch.searchsorted``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE
from sglang_cpkv.ops.reference import PageInverse
from sglang_cpkv.ops.triton._common import check_errors, check_index, next_power_of_2

# GPU: 1024 entries per program (a 256K-token batch of 64-token pages is 4096 entries: 4 programs).
_GPU_BLOCK = 1024
# Interpreter: each program instance costs ~1 ms, so one program for up to 64K entries.
_CPU_MAX_BLOCK = 1 << 16


@triton.jit
def _inverse_keys_kernel(
    entry_pages_ptr,  # int32/int64 [E]
    entry_req_ptr,  # int64 [E]
    entry_slots_ptr,  # int32 [E]
    keys_ptr,  # int64 [E], written
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    num_entries,  # E
    num_requests,  # R
    capacity,  # C
    BLOCK: tl.constexpr,
    ERR_PAGE: tl.constexpr,
    ERR_REQ: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = e < num_entries
    page = tl.load(entry_pages_ptr + e, mask=in_range, other=-1).to(tl.int64)
    req = tl.load(entry_req_ptr + e, mask=in_range, other=-1).to(tl.int64)
    slot = tl.load(entry_slots_ptr + e, mask=in_range, other=-1).to(tl.int64)
    padding = (page == -1) | (req == -1)
    bad_page = ~padding & ((page >= capacity) | (page < -1) | (slot < 0))
    bad_req = ~padding & ~bad_page & ((req >= num_requests) | (req < -1))
    valid = ~(padding | bad_page | bad_req)
    tl.store(keys_ptr + e, tl.where(valid, req * capacity + page, num_requests * capacity), mask=in_range)
    n_bad_page = tl.sum((in_range & bad_page).to(tl.int32), axis=0)
    n_bad_req = tl.sum((in_range & bad_req).to(tl.int32), axis=0)
    tl.atomic_add(errors_ptr + ERR_PAGE, n_bad_page, mask=n_bad_page > 0)
    tl.atomic_add(errors_ptr + ERR_REQ, n_bad_req, mask=n_bad_req > 0)


@triton.jit
def _inverse_runs_kernel(
    sorted_keys_ptr,  # int64 [E], ascending
    order_ptr,  # int64 [E], the entry at each sorted position
    entry_slots_ptr,  # int32 [E]
    pages_ptr,  # int32 [E], written
    slots_ptr,  # int32 [E], written
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    num_entries,  # E
    end_key,  # R * C: the key of what is not an entry
    capacity,  # C
    BLOCK: tl.constexpr,
    ERR_PAGE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = i < num_entries
    key = tl.load(sorted_keys_ptr + i, mask=in_range, other=end_key)
    held = in_range & (key < end_key)
    previous = tl.load(sorted_keys_ptr + i - 1, mask=held & (i > 0), other=-1)
    entry = tl.load(order_ptr + i, mask=held, other=0)
    slot = tl.load(entry_slots_ptr + entry, mask=held, other=-1)
    tl.store(pages_ptr + i, tl.where(held, key % capacity, -1).to(tl.int32), mask=in_range)
    tl.store(slots_ptr + i, tl.where(held, slot, -1).to(tl.int32), mask=in_range)
    n_repeated = tl.sum((held & (previous == key)).to(tl.int32), axis=0)
    tl.atomic_add(errors_ptr + ERR_PAGE, n_repeated, mask=n_repeated > 0)


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
    end_key = num_requests * capacity
    keys = torch.empty(num_entries, dtype=torch.int64, device=device)
    pages = torch.empty(num_entries, dtype=torch.int32, device=device)
    slots = torch.empty(num_entries, dtype=torch.int32, device=device)
    on_cpu = device.type == "cpu"
    block = block or (min(next_power_of_2(max(num_entries, 1)), _CPU_MAX_BLOCK) if on_cpu else _GPU_BLOCK)
    grid = (triton.cdiv(num_entries, block),)
    if num_entries:
        _inverse_keys_kernel[grid](
            entry_pages,
            entry_req,
            entry_slots,
            keys,
            errors,
            num_entries,
            num_requests,
            capacity,
            BLOCK=block,
            ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
            ERR_REQ=ERR_REQ_OUT_OF_RANGE,
            num_warps=num_warps,
        )
    sorted_keys, order = keys.sort()
    if num_entries:
        _inverse_runs_kernel[grid](
            sorted_keys,
            order,
            entry_slots,
            pages,
            slots,
            errors,
            num_entries,
            end_key,
            capacity,
            BLOCK=block,
            ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
            num_warps=num_warps,
        )
    boundaries = torch.arange(num_requests + 1, dtype=torch.int64, device=device) * capacity
    starts = torch.searchsorted(sorted_keys, boundaries, out_int32=True)
    return PageInverse(pages=pages, slots=slots, starts=starts, capacity=capacity)
