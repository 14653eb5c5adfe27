"""Triton :func:`copy_pages`: ``dst[dst_page[i]] = src[src_page[i]]``, whole pages, byte-exact.

Contract: :func:`sglang_cpkv.ops.reference.copy_pages`.

Pages are viewed as rows of the widest integer word that divides the page width and strides
(8 bytes for the bf16 and the 656-byte packed FP8 layouts at any page size), so one kernel serves
every element type. Program ``(i, c)`` copies chunk ``c`` of pair ``i``; a skipped or bad pair
moves no bytes (its loads and stores are masked off).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_PAGE_OUT_OF_RANGE
from sglang_cpkv.ops.reference import check_page_pairs, implements
from sglang_cpkv.ops.reference import copy_pages as contract
from sglang_cpkv.ops.triton._common import (
    check_errors,
    check_index,
    next_power_of_2,
    word_rows,
)

# GPU: 4 KiB per program (512 8-byte words; 4 warps: two 16-byte accesses per thread). H200,
# 2026-11-30 (benchmark/results/2026-11-30-h200), 8 x 131072 tokens/request: 4 KiB moved
# 3962 GB/s (656-byte rows) and 3978 GB/s (1152-byte rows), 8 KiB 3916 / 3857, 16 KiB with 8
# warps 3926 / 3865; torch.index_select of the same pages 3748 / 3866.
_GPU_BLOCK_BYTES = 4096
# Interpreter: each program instance costs ~1 ms, so one program per page.
_CPU_MAX_BLOCK_WORDS = 1 << 16


@triton.jit
def _copy_pages_kernel(
    src_ptr,  # words [src_pages, page_words], row stride src_stride
    src_page_ptr,  # int32/int64 [S]
    dst_ptr,  # words [dst_pages, page_words], row stride dst_stride; written
    dst_page_ptr,  # int32/int64 [S]
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    src_pages,
    dst_pages,
    src_stride,
    dst_stride,
    page_words,
    ALIGN: tl.constexpr,  # power of two dividing both strides (tl.multiple_of hint)
    BLOCK_WORDS: tl.constexpr,
    ERR_PAGE: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    s = tl.load(src_page_ptr + pair).to(tl.int64)
    d = tl.load(dst_page_ptr + pair).to(tl.int64)
    bad = (s >= src_pages) | (s < -1) | (d >= dst_pages) | (d < -1)
    ok = (s >= 0) & (d >= 0) & ~bad
    tl.atomic_add(errors_ptr + ERR_PAGE, 1, mask=bad & (chunk == 0))

    words = chunk.to(tl.int64) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    # where(), not `&`: Triton 3.9's interpreter mistypes `block & scalar` masks (int32 data).
    mask = tl.where(ok, words < page_words, False)
    src_row = tl.multiple_of(s * src_stride, ALIGN)
    dst_row = tl.multiple_of(d * dst_stride, ALIGN)
    values = tl.load(src_ptr + src_row + words, mask=mask)
    tl.store(dst_ptr + dst_row + words, values, mask=mask)


@implements(contract)
def copy_pages(src, src_page, dst, dst_page, errors, *, block_words: int = 0, num_warps: int = 4) -> None:
    """Copy whole pages (contract: :func:`sglang_cpkv.ops.reference.copy_pages`).

    Args:
        src: ``[src_pages, ...]`` paged tensor, one page per leading index, pages contiguous.
        src_page: int32/int64 ``[S]`` pages of ``src``.
        dst: ``[dst_pages, ...]``, same dtype and page shape; written in place.
        dst_page: int32/int64 ``[S]`` pages of ``dst``.
        errors: int32 counter: an index ``>=`` its tensor's page count or ``< -1``.
        block_words: words copied per program (power of two; a word is the widest integer of
            8/4/2/1 bytes dividing the page width). 0 = auto: 4 KiB worth on a GPU; on CPU
            (interpreter) the whole page, up to 65536 words.
        num_warps: warps per program.
    """
    check_page_pairs(src, src_page, dst, dst_page)
    device = dst.device
    src_page = check_index("src_page", src_page, device)
    dst_page = check_index("dst_page", dst_page, device)
    check_errors(errors, device)
    n_pairs = src_page.numel()
    src_words, dst_words, word_bytes, align = word_rows(src, dst)
    page_words = src_words.shape[1]
    if n_pairs == 0 or page_words == 0:
        return
    if device.type == "cpu":
        block_words = block_words or min(next_power_of_2(page_words), _CPU_MAX_BLOCK_WORDS)
    else:
        block_words = block_words or min(next_power_of_2(page_words), _GPU_BLOCK_BYTES // word_bytes)
    grid = (n_pairs, triton.cdiv(page_words, block_words))
    _copy_pages_kernel[grid](
        src_words,
        src_page,
        dst_words,
        dst_page,
        errors,
        src_words.shape[0],
        dst_words.shape[0],
        src_words.stride(0),
        dst_words.stride(0),
        page_words,
        ALIGN=align,
        BLOCK_WORDS=block_words,
        ERR_PAGE=ERR_PAGE_OUT_OF_RANGE,
        num_warps=num_warps,
    )
