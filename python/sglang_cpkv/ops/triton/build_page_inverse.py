"""Triton :func:`build_page_inverse`: the page of every dense slot -> per-request inverse.

Contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`.

The inverse is filled with -1 (one ``fill_``), then one program per block of slots claims entry
``slot_req[s] * C + slot_pages[s]`` for slot ``s`` with an atomic compare-and-swap from -1: the first
slot of a request to claim a page wins, and a slot that finds the entry taken is counted (a page twice
in one request). Lanes past the slot count compare against -2, which no entry ever holds, so they never
write (``atomic_cas`` has no mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE
from sglang_cpkv.ops.triton._common import check_errors, check_index, next_power_of_2

# GPU: 1024 slots per program (a 256K-token batch of 64-token pages is 4096 slots: 4 programs).
_GPU_BLOCK = 1024
# Interpreter: each program instance costs ~1 ms, so one program for up to 64K slots.
_CPU_MAX_BLOCK = 1 << 16


@triton.jit
def _build_page_inverse_kernel(
    slot_pages_ptr,  # int32/int64 [S]
    slot_req_ptr,  # int64 [S]
    inverse_ptr,  # int32 [R * C], all -1 on entry
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    num_slots,  # S
    num_requests,  # R
    capacity,  # C
    BLOCK: tl.constexpr,
    ERR_PAGE: tl.constexpr,
    ERR_REQ: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = slot < num_slots
    page = tl.load(slot_pages_ptr + slot, mask=in_range, other=-1).to(tl.int64)
    req = tl.load(slot_req_ptr + slot, mask=in_range, other=-1).to(tl.int64)
    padding = (page == -1) | (req == -1)
    bad_page = ~padding & ((page >= capacity) | (page < -1))
    bad_req = ~padding & ~bad_page & ((req >= num_requests) | (req < -1))
    valid = in_range & ~(padding | bad_page | bad_req)
    entry = tl.where(valid, req * capacity + page, 0)
    claimed = tl.atomic_cas(inverse_ptr + entry, tl.where(valid, -1, -2).to(tl.int32), slot.to(tl.int32))
    repeated = valid & (claimed != -1)
    n_bad_page = tl.sum((in_range & bad_page).to(tl.int32) + repeated.to(tl.int32), axis=0)
    n_bad_req = tl.sum((in_range & bad_req).to(tl.int32), axis=0)
    tl.atomic_add(errors_ptr + ERR_PAGE, n_bad_page, mask=n_bad_page > 0)
    tl.atomic_add(errors_ptr + ERR_REQ, n_bad_req, mask=n_bad_req > 0)


def build_page_inverse(
    slot_pages: torch.Tensor,
    slot_req: torch.Tensor,
    num_requests: int,
    capacity: int,
    errors: torch.Tensor,
    *,
    block: int = 0,
    num_warps: int = 4,
) -> torch.Tensor:
    """Per-request page inverse (contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`).

    Args:
        slot_pages: int32/int64 ``[S]``; slot_req: int64 ``[S]``; num_requests: ``R``; capacity: ``C``.
        errors: int32 ``[NUM_ERROR_KINDS]`` counter.
        block: slots per program (power of two). 0 = auto: 1024 on a GPU, ``next_power_of_2(S)`` up to
            65536 on CPU (the interpreter).
        num_warps: warps per program.

    Returns:
        int32 ``[R * C]``.
    """
    slot_pages = check_index("slot_pages", slot_pages, slot_pages.device)
    slot_req = check_index("slot_req", slot_req, slot_pages.device)
    if slot_pages.shape != slot_req.shape:
        raise ValueError(
            f"slot_pages and slot_req must be 1-D of one length, got {tuple(slot_pages.shape)} and {tuple(slot_req.shape)}"
        )
    if capacity < 1 or num_requests < 0:
        raise ValueError(f"capacity must be >= 1 and num_requests >= 0, got {capacity}, {num_requests}")
    check_errors(errors, slot_pages.device)
    inverse = torch.full((num_requests * capacity,), -1, dtype=torch.int32, device=slot_pages.device)
    num_slots = slot_pages.numel()
    if num_slots == 0 or inverse.numel() == 0:
        return inverse
    on_cpu = slot_pages.device.type == "cpu"
    block = block or (min(next_power_of_2(num_slots), _CPU_MAX_BLOCK) if on_cpu else _GPU_BLOCK)
    _build_page_inverse_kernel[(triton.cdiv(num_slots, block),)](
        slot_pages,
        slot_req,
        inverse,
        errors,
        num_slots,
        num_requests,
        capacity,
        BLOCK=block,
        ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
        ERR_REQ=ERR_REQ_OUT_OF_RANGE,
        num_warps=num_warps,
    )
    return inverse
