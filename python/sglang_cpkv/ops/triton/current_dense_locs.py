"""Triton :func:`current_dense_locs`: each current token's dense location, and the count of tokens whose pool
location disagrees with it.

Contract: :func:`sglang_cpkv.ops.reference.current_dense_locs`.

One lane per token: its request is found by a binary search of ``token_ends`` (``R`` values, a few cached loads per
token: the plan stages per-request values only, never a per-token array), its slot's page read from ``slot_pages``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_cpkv.ops.errors import ERR_CURRENT_LOC_MISMATCH
from sglang_cpkv.ops.reference import check_current_locs, implements
from sglang_cpkv.ops.reference import current_dense_locs as contract
from sglang_cpkv.ops.triton._common import check_errors, check_index

_GPU_BLOCK = 256
_CPU_BLOCK = 1 << 16  # interpreter: each program instance costs ~1 ms, so few large ones


@triton.jit
def _current_dense_locs_kernel(
    token_ends_ptr,  # int64 [R], nondecreasing
    dense_offsets_ptr,  # int64 [R]
    out_cache_loc_ptr,  # int32/int64 [N]
    slot_pages_ptr,  # int32 [S]
    out_ptr,  # int64 [N]
    errors_ptr,  # int32 [NUM_ERROR_KINDS]
    n_tokens,  # N
    n_requests,  # R
    n_slots,  # S
    search_steps,  # bit_length(R): steps that narrow [0, R] to one request
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    ERR_MISMATCH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t < n_tokens
    # Request of token t: the number of requests whose tokens end at or before it (upper bound in token_ends).
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + n_requests
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        open_ = lo < hi
        end = tl.load(token_ends_ptr + mid, mask=live & open_, other=0)
        right = open_ & (end <= t)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    found = live & (lo < n_requests)
    dense = tl.where(found, tl.load(dense_offsets_ptr + lo, mask=found, other=0) + t, -1)
    slot = dense // PAGE_SIZE
    in_view = found & (dense >= 0) & (slot < n_slots)
    page = tl.load(slot_pages_ptr + slot, mask=in_view, other=-1).to(tl.int64)
    loc = tl.load(out_cache_loc_ptr + t, mask=live, other=-1).to(tl.int64)
    agrees = in_view & (page >= 0) & (page * PAGE_SIZE + dense % PAGE_SIZE == loc)
    tl.store(out_ptr + t, dense, mask=live)
    n_bad = tl.sum((live & ~agrees).to(tl.int32), axis=0)
    tl.atomic_add(errors_ptr + ERR_MISMATCH, n_bad, mask=n_bad > 0)


@implements(contract)
def current_dense_locs(
    token_ends, dense_offsets, out_cache_loc, slot_pages, page_size, errors, *, block: int = 0
) -> torch.Tensor:
    """Current tokens' dense locations (contract: :func:`sglang_cpkv.ops.reference.current_dense_locs`).

    Args:
        block: tokens per program (power of two). 0 = auto: 256 on a GPU, 65536 under the interpreter.
    """
    check_current_locs(token_ends, dense_offsets, out_cache_loc, slot_pages)
    device = out_cache_loc.device
    for name, t in (("token_ends", token_ends), ("dense_offsets", dense_offsets), ("slot_pages", slot_pages)):
        check_index(name, t, device)
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    check_errors(errors, device)
    n_tokens = out_cache_loc.numel()
    out = torch.empty(n_tokens, dtype=torch.int64, device=device)
    if n_tokens == 0:
        return out
    block = block or (_CPU_BLOCK if device.type == "cpu" else _GPU_BLOCK)
    block = min(block, triton.next_power_of_2(n_tokens))
    n_requests = token_ends.numel()
    _current_dense_locs_kernel[(triton.cdiv(n_tokens, block),)](
        token_ends.contiguous(),
        dense_offsets.contiguous(),
        out_cache_loc.contiguous(),
        slot_pages.contiguous(),
        out,
        errors,
        n_tokens,
        n_requests,
        slot_pages.numel(),
        n_requests.bit_length(),
        PAGE_SIZE=page_size,
        BLOCK=block,
        ERR_MISMATCH=ERR_CURRENT_LOC_MISMATCH,
    )
    return out
