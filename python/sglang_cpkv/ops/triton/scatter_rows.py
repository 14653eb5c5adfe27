"""Triton :func:`scatter_rows`: ``dst[dst_loc[i]] = src[i]``, byte-exact rows.

Contract: :func:`sglang_cpkv.ops.reference.scatter_rows`.

Rows are viewed as the widest integer word dividing the row width and strides (8 bytes for both
the 1152-byte bf16 and the 656-byte packed FP8 rows). The row width in words is a compile-time
constant: the column mask then has a known granularity and, with the ``tl.multiple_of`` hint on
row offsets, the copies use 16-byte accesses even for 82-word (656-byte) rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE
from sglang_cpkv.ops.reference import check_row_scatter, implements
from sglang_cpkv.ops.reference import scatter_rows as contract
from sglang_cpkv.ops.triton._common import (
    check_errors,
    check_index,
    next_power_of_2,
    word_rows,
)

# GPU: 8 rows per program, at most 1024 words per row step. H200, 2026-11-30
# (benchmark/results/2026-11-30-h200), 8 x 131072 rows: 656-byte rows 4100 GB/s with 8 rows
# and 4 warps (16 rows: 4033, 32 rows and 8 warps: 4007); 1152-byte rows 4078-4127 GB/s for
# 8-32 rows (within noise); a contiguous torch copy_ of the same bytes 4139 GB/s.
_GPU_BLOCK_ROWS = 8
_GPU_MAX_BLOCK_WORDS = 1024
# Interpreter: each program instance costs ~1 ms, so few large tiles.
_CPU_TILE_WORDS = 1 << 16


@triton.jit
def _scatter_rows_kernel(
    src_ptr,  # words [N, ROW_WORDS], row stride src_stride
    dst_loc_ptr,  # int32/int64 [N]; -1 = skip
    dst_ptr,  # words [M, ROW_WORDS], row stride dst_stride; written
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    n_rows,  # N
    dst_rows,  # M
    src_stride,
    dst_stride,
    ROW_WORDS: tl.constexpr,
    ALIGN: tl.constexpr,  # power of two dividing both strides (tl.multiple_of hint)
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    ERR_LOC: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_in = rows < n_rows
    loc = tl.load(dst_loc_ptr + rows, mask=row_in, other=-1).to(tl.int64)
    bad = row_in & ((loc >= dst_rows) | (loc < -1))
    ok = row_in & (loc >= 0) & (loc < dst_rows)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    tl.atomic_add(errors_ptr + ERR_LOC, n_bad, mask=n_bad > 0)

    src_row = tl.multiple_of(rows * src_stride, ALIGN)[:, None]
    dst_row = tl.multiple_of(loc * dst_stride, ALIGN)[:, None]
    for start in tl.static_range(0, ROW_WORDS, BLOCK_WORDS):
        words = start + tl.arange(0, BLOCK_WORDS)[None, :]
        mask = ok[:, None] & (words < ROW_WORDS)
        values = tl.load(src_ptr + src_row + words, mask=mask)
        tl.store(dst_ptr + dst_row + words, values, mask=mask)


@implements(contract)
def scatter_rows(src, dst_loc, dst, errors, *, block_rows: int = 0, num_warps: int = 4) -> None:
    """Scatter rows (contract: :func:`sglang_cpkv.ops.reference.scatter_rows`).

    Args:
        src: ``[N, ...]`` rows, each contiguous.
        dst_loc: int32/int64 ``[N]`` destination rows (``-1``: skip).
        dst: ``[M, ...]``, same dtype and row shape; written in place.
        errors: int32 counter: a row ``>= M`` or ``< -1``.
        block_rows: rows per program (power of two). 0 = auto: 8 on a GPU; on CPU (interpreter,
            where every program instance costs ~1 ms) a tile of up to 65536 words.
        num_warps: warps per program.
    """
    check_row_scatter(src, dst_loc, dst)
    device = dst.device
    dst_loc = check_index("dst_loc", dst_loc, device)
    check_errors(errors, device)
    src_words, dst_words, _, align = word_rows(src, dst)
    n_rows, row_words = src_words.shape
    if n_rows == 0 or row_words == 0:
        return
    if device.type == "cpu":
        block_words = min(next_power_of_2(row_words), _CPU_TILE_WORDS)
        block_rows = block_rows or max(1, min(next_power_of_2(n_rows), _CPU_TILE_WORDS // block_words))
    else:
        block_words = min(next_power_of_2(row_words), _GPU_MAX_BLOCK_WORDS)
        block_rows = block_rows or _GPU_BLOCK_ROWS
    _scatter_rows_kernel[(triton.cdiv(n_rows, block_rows),)](
        src_words,
        dst_loc,
        dst_words,
        errors,
        n_rows,
        dst_words.shape[0],
        src_words.stride(0),
        dst_words.stride(0),
        ROW_WORDS=row_words,
        ALIGN=align,
        BLOCK_ROWS=block_rows,
        BLOCK_WORDS=block_words,
        ERR_LOC=ERR_LOC_OUT_OF_RANGE,
        num_warps=num_warps,
    )
