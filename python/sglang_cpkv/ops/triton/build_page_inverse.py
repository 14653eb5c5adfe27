"""Triton :func:`build_page_inverse`: page table -> per-request inverse, in one launch.

Contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`.

Program ``(r, c)`` owns inverse entries ``[r*C + c*BLOCK_C, r*C + (c+1)*BLOCK_C)``: it fills them
with -1, then scans request ``r``'s page-table row and writes the slots whose page id falls in
its range. Every inverse entry has exactly one writer program, so fill and scatter fuse into one
launch without a race between programs (a separate fill launch plus scatter is what made the
torch build cost 19-27 us on the H200); a block barrier orders the two phases inside a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_PAGE_OUT_OF_RANGE
from sglang_cpkv.ops.triton._common import check_errors, next_power_of_2

# GPU: 2048 int32 entries (8 KiB) per program keeps >= 160 programs at bs 8 with a 40K-page pool
# while each program re-reads its request's page-table row only C / 2048 times in all.
_GPU_BLOCK_C = 2048
_GPU_MAX_BLOCK_P = 1024
# Interpreter: each program instance costs ~1 ms, so one program per request row.
_CPU_MAX_BLOCK = 1 << 16


@triton.jit
def _build_page_inverse_kernel(
    page_table_ptr,  # int32/int64 [R, P], row stride page_table_stride
    inverse_ptr,  # int32 [R * C], written (every entry)
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    capacity,  # C
    pages_per_request,  # P
    page_table_stride,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ERR_PAGE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lo = chunk.to(tl.int64) * BLOCK_C
    hi = lo + BLOCK_C
    inverse_row = inverse_ptr + row * capacity

    entries = lo + tl.arange(0, BLOCK_C)
    tl.store(inverse_row + entries, tl.full((BLOCK_C,), -1, tl.int32), mask=entries < capacity)
    # The slots below may land on entries other threads of this program just filled.
    tl.debug_barrier()

    bad_count = tl.zeros((BLOCK_P,), dtype=tl.int32)
    for start in range(0, pages_per_request, BLOCK_P):
        j = start + tl.arange(0, BLOCK_P).to(tl.int64)
        in_row = j < pages_per_request
        page = tl.load(page_table_ptr + row * page_table_stride + j, mask=in_row, other=-1).to(tl.int64)
        mine = in_row & (page >= lo) & (page < hi) & (page < capacity)
        slot = row * pages_per_request + j
        tl.store(inverse_row + page, slot.to(tl.int32), mask=mine)
        bad_count += (in_row & ((page >= capacity) | (page < -1))).to(tl.int32)
    # Each request row's bad ids are counted once, by its first chunk.
    n_bad = tl.sum(bad_count, axis=0)
    tl.atomic_add(errors_ptr + ERR_PAGE, n_bad, mask=(chunk == 0) & (n_bad > 0))


def build_page_inverse(
    page_table: torch.Tensor,
    capacity: int,
    errors: torch.Tensor,
    *,
    block_c: int = 0,
    block_p: int = 0,
    num_warps: int = 4,
) -> torch.Tensor:
    """Per-request page inverse of a batch (contract: :func:`sglang_cpkv.ops.reference.build_page_inverse`).

    Args:
        page_table: int32 (or int64) ``[R, P]`` page ids, ``-1`` past a request's last page.
        capacity: ``C``, the number of page ids of the pool.
        errors: int32 ``[NUM_ERROR_KINDS]`` counter; page ids ``>= C`` or ``< -1`` are counted.
        block_c: inverse entries per program (power of two). 0 = auto: 2048 on a GPU; on CPU
            (interpreter) ``next_power_of_2(C)`` up to 65536, i.e. one program per request row.
        block_p: page-table entries scanned per step (power of two). 0 = auto:
            ``next_power_of_2(P)``, at most 1024 on a GPU and 65536 on CPU.
        num_warps: warps per program.

    Returns:
        int32 ``[R * C]``.
    """
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_table must be int32/int64 [R, P], got {page_table.dtype}{tuple(page_table.shape)}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    check_errors(errors, page_table.device)
    rows, pages_per_request = page_table.shape
    inverse = torch.empty(rows * capacity, dtype=torch.int32, device=page_table.device)
    if inverse.numel() == 0:
        return inverse
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    on_cpu = page_table.device.type == "cpu"
    block_c = block_c or min(next_power_of_2(capacity), _CPU_MAX_BLOCK if on_cpu else _GPU_BLOCK_C)
    block_p = block_p or min(next_power_of_2(pages_per_request), _CPU_MAX_BLOCK if on_cpu else _GPU_MAX_BLOCK_P)
    grid = (rows, triton.cdiv(capacity, block_c))
    _build_page_inverse_kernel[grid](
        page_table,
        inverse,
        errors,
        capacity,
        pages_per_request,
        page_table.stride(0),
        BLOCK_C=block_c,
        BLOCK_P=block_p,
        ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
        num_warps=num_warps,
    )
    return inverse
