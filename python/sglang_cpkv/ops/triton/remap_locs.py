"""Triton :func:`remap_locs`: token locations of each request -> its dense locations.

Contract: :func:`sglang_cpkv.ops.reference.remap_locs`.

Request ids are compact: one int64 per row of ``locs`` (``[N]`` for ``[N, K]`` top-k locations),
loaded once per tile row and broadcast in registers, never materialized as ``[N, K]``. Each location's key
``(request, page id)`` is looked up in the inverse's hash table from its home cell to its key or an empty cell (one
or two probes on average; the loop ends when every lane of the tile has). The page size is a compile-time constant
so that ``// page_size`` and ``% page_size`` are shifts for the usual power-of-two sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE
from sglang_cpkv.ops.reference import EMPTY_KEY, HASH_MULTIPLIER, implements
from sglang_cpkv.ops.reference import remap_locs as contract
from sglang_cpkv.ops.triton._common import check_errors, check_index, next_power_of_2
from sglang_cpkv.ops.triton.build_page_inverse import find_cells

# GPU: 128 locations per program, one warp: a program's probe loop runs until its slowest lane is done, so small
# programs wait less (one H200, 4096 x 2048 top-k: 104 us at 128 x 1 warp, 96 us at 64, 333 us at 4096 x 4 warps;
# benchmark/results/2026-12-03-h200-hash-inverse/triton_tiles.txt).
_GPU_TILE = 128
_GPU_MAX_BLOCK_K = 128
_GPU_WARPS = 1
# Interpreter: each program instance costs ~1 ms, so few large tiles.
_CPU_TILE = 1 << 16


@triton.jit
def _remap_locs_kernel(
    locs_ptr,  # int32/int64 [N, K], row stride locs_stride
    req_id_ptr,  # int64 [N]; -1 = padding row
    inverse_keys_ptr,  # int64 [T]: r * C + page, or EMPTY
    inverse_slots_ptr,  # int32 [T]
    table_mask,  # T - 1
    out_ptr,  # int32 [N, K], contiguous
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    n_rows,  # N
    n_cols,  # K
    locs_stride,
    capacity,  # C
    batch_rows,  # R
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMPTY: tl.constexpr,
    MULTIPLIER: tl.constexpr,
    ERR_PAGE: tl.constexpr,
    ERR_REQ: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_in = rows < n_rows
    tile_in = row_in[:, None] & (cols < n_cols)[None, :]

    req = tl.load(req_id_ptr + rows, mask=row_in, other=-1).to(tl.int64)[:, None]
    loc = tl.load(locs_ptr + rows[:, None] * locs_stride + cols[None, :], mask=tile_in, other=-1).to(tl.int64)

    padding = (loc == -1) | (req == -1)
    bad_req = ~padding & ((req < -1) | (req >= batch_rows))
    page = loc // PAGE_SIZE
    bad_page = ~padding & ~bad_req & ((loc < 0) | (page >= capacity))
    ok = ~padding & ~bad_req & ~bad_page

    cell = find_cells(inverse_keys_ptr, tl.where(ok, req * capacity + page, 0), ok, table_mask, EMPTY, MULTIPLIER)
    slot = tl.load(inverse_slots_ptr + cell, mask=cell >= 0, other=-1).to(tl.int64)
    dense = tl.where(slot >= 0, slot * PAGE_SIZE + loc % PAGE_SIZE, -1)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], dense.to(tl.int32), mask=tile_in)

    n_bad_req = tl.sum(tl.sum(bad_req.to(tl.int32), axis=1), axis=0)
    n_bad_page = tl.sum(tl.sum(bad_page.to(tl.int32), axis=1), axis=0)
    tl.atomic_add(errors_ptr + ERR_REQ, n_bad_req, mask=n_bad_req > 0)
    tl.atomic_add(errors_ptr + ERR_PAGE, n_bad_page, mask=n_bad_page > 0)


@implements(contract)
def remap_locs(
    locs, req_id, inverse, page_size, errors, out=None, *, block_n: int = 0, block_k: int = 0, num_warps: int = 0
) -> torch.Tensor:
    """Map token locations to dense locations (contract: :func:`sglang_cpkv.ops.reference.remap_locs`).

    Args:
        locs: int32 or int64 ``[N]`` or ``[N, K]``; ``-1`` is padding, another negative location a bad id.
        req_id: int32/int64 ``[N]`` request row of each row of ``locs`` (``-1``: padding row).
        inverse: :class:`~sglang_cpkv.ops.reference.PageInverse` of the batch (``R`` requests, capacity ``C``).
        page_size: tokens per page.
        errors: int32 counter (request ids outside ``[-1, R)``, locations below -1, pages ``>= C``).
        block_k: locations per tile along a row (power of two). 0 = auto:
            ``next_power_of_2(K)``, at most 128 on a GPU.
        block_n: rows per tile (power of two). 0 = auto: a tile of 128 locations on a GPU, of
            65536 on CPU (interpreter, where every program instance costs ~1 ms).
        num_warps: warps per program. 0 = auto: 1 on a GPU (4 under the interpreter, where it has no effect).

    Returns:
        int32, the shape of ``locs``.
    """
    device = locs.device
    loc2d = check_index("locs", locs, device, dims=(1, 2))
    if loc2d.dim() == 1:
        loc2d = loc2d.reshape(-1, 1)
    if req_id.shape != loc2d.shape[:1]:
        raise ValueError(
            f"req_id must have one id per row of locs: locs {tuple(locs.shape)}, req_id {tuple(req_id.shape)}"
        )
    req_id = check_index("req_id", req_id, device)
    for name, dtype in (("keys", torch.int64), ("slots", torch.int32)):
        part = getattr(inverse, name)
        if part.dtype != dtype or part.dim() != 1 or part.device != device or not part.is_contiguous():
            raise ValueError(
                f"inverse.{name} must be a contiguous {dtype} 1-D tensor on {device}, got "
                f"{part.dtype}{tuple(part.shape)} on {part.device}"
            )
    size = inverse.table_size
    if inverse.capacity <= 0 or size < 2 or size & (size - 1) or inverse.slots.numel() != size:
        raise ValueError(
            f"inverse must have capacity > 0 and a power-of-two table of keys with as many slots, got capacity "
            f"{inverse.capacity}, {size} keys, {inverse.slots.numel()} slots"
        )
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    check_errors(errors, device)
    n_rows, n_cols = loc2d.shape
    # out may be locs itself: a program loads its tile of locs before it stores the tile's results.
    given = out
    out = (
        torch.empty((n_rows, n_cols), dtype=torch.int32, device=device) if given is None else given.view(n_rows, n_cols)
    )
    if out.numel() == 0:
        return out.reshape(locs.shape) if given is None else given
    tile = _CPU_TILE if device.type == "cpu" else _GPU_TILE
    block_k = block_k or min(next_power_of_2(n_cols), tile if device.type == "cpu" else _GPU_MAX_BLOCK_K)
    block_n = block_n or max(1, min(next_power_of_2(n_rows), tile // block_k))
    num_warps = num_warps or (4 if device.type == "cpu" else _GPU_WARPS)
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(n_cols, block_k))
    _remap_locs_kernel[grid](
        loc2d,
        req_id,
        inverse.keys,
        inverse.slots,
        size - 1,
        out,
        errors,
        n_rows,
        n_cols,
        loc2d.stride(0),
        inverse.capacity,
        inverse.num_requests,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EMPTY=EMPTY_KEY,
        MULTIPLIER=HASH_MULTIPLIER,
        ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
        ERR_REQ=ERR_REQ_OUT_OF_RANGE,
        num_warps=num_warps,
    )
    return out.reshape(locs.shape) if given is None else given
