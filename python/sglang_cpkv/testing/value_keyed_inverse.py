"""The negative control: the seed's 1-D value-keyed page inverse (last writer wins), kept only to show what goes wrong.

:func:`value_keyed_pipeline` runs the seed's per-layer pipeline with the 1-D inverse and its value-keyed current-page
mask: harmless on the REACHABLE class, contamination on the COLLISION class. Callers: tests that assert it fails
there, the demo, the multi-GPU harness. Why: ``docs/design/cp-shared-kv-testing.md`` ("The negative control").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_cpkv.testing.batches import BatchCase, padded_page_table, same_bytes, truth_rows

PADDING_ID = -1


def build_value_keyed_inverse(page_table: torch.Tensor, capacity: int) -> torch.Tensor:
    """int32 ``[C]``: for each page id, the highest dense slot ``r * P + j`` holding it (last writer wins), else -1.

    Args:
        page_table: int32 ``[R, P]`` page ids, -1 for none.
    """
    flat = page_table.reshape(-1).to(torch.int64)
    slot = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    valid = flat >= 0
    inverse = torch.full((capacity,), PADDING_ID, dtype=torch.int64, device=flat.device)
    inverse.scatter_reduce_(0, flat[valid], slot[valid], reduce="amax")
    return inverse.to(torch.int32)


def remap_value_keyed(locs: torch.Tensor, inverse_1d: torch.Tensor, page_size: int) -> torch.Tensor:
    """int32, shape of ``locs``: ``inverse_1d[loc // ps] * ps + loc % ps`` (no request id at all); -1 stays -1."""
    loc = locs.to(torch.int64)
    slot = torch.where(loc >= 0, inverse_1d.to(torch.int64)[loc.clamp(min=0) // page_size], PADDING_ID)
    return torch.where(slot >= 0, slot * page_size + loc % page_size, PADDING_ID).to(torch.int32)


def value_keyed_current_page_mask(
    page_table: torch.Tensor, prefix_lens: Sequence[int], extend_lens: Sequence[int], capacity: int, page_size: int
) -> torch.Tensor:
    """bool ``[C]``: page ids that hold only current tokens in *some* request (global, value-keyed)."""
    mask = torch.zeros(capacity, dtype=torch.bool)
    table = page_table.cpu().to(torch.int64)
    for r, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        first_current_only = -(-prefix // page_size)
        last = -(-(prefix + extend) // page_size)
        pages = table[r, first_current_only:last]
        mask[pages[pages >= 0]] = True
    return mask.to(page_table.device)


def value_keyed_pipeline(
    case: BatchCase, pool: torch.Tensor, current_kv: torch.Tensor, topk_locs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's cp=1 layer over ``case`` with the 1-D inverse: (dense ``[R * P * ps, row]`` with ``P`` the longest
    page table, remapped top-k int32).

    Args:
        pool: ``[C * ps, row]``. current_kv: ``[N, row]`` token order. topk_locs: ``[N, K]`` pool locations (-1
        padding).
    """
    page_table = padded_page_table(case, max(len(t) for t in case.page_tables))
    prefix_lens, capacity, page_size = case.prefix_lens, case.capacity, case.page_size
    out_cache_loc = torch.tensor(case.out_cache_loc(), dtype=torch.int64)
    rows, pages_per_request = page_table.shape
    inverse_1d = build_value_keyed_inverse(page_table, capacity)
    current_page = value_keyed_current_page_mask(page_table, prefix_lens, case.extend_lens, capacity, page_size)
    dense = pool.new_zeros((rows * pages_per_request * page_size, *pool.shape[1:]))
    dense_pages = dense.view(rows * pages_per_request, -1)
    pool_pages = pool.view(capacity, -1)
    for r, prefix in enumerate(prefix_lens):
        for j in range(-(-prefix // page_size)):
            page = int(page_table[r, j])
            if not bool(current_page[page]):  # the seed's global mask: "current pages are filled, not read"
                dense_pages[r * pages_per_request + j] = pool_pages[page]
    fill_locs = remap_value_keyed(out_cache_loc, inverse_1d, page_size).to(torch.int64)
    keep = fill_locs >= 0
    dense[fill_locs[keep]] = current_kv[keep]
    return dense, remap_value_keyed(topk_locs, inverse_1d, page_size)


def value_keyed_read_mismatches(
    case: BatchCase, pool: torch.Tensor, current_kv: torch.Tensor, topk_locs: torch.Tensor, topk_positions: torch.Tensor
) -> list[tuple[int, int, int]]:
    """The negative control (cp=1): ``(token, request, position)`` of every top-k read through the
    1-D value-keyed inverse that does not return the truth row (dropped or another row)."""
    dense, remapped = value_keyed_pipeline(case, pool, current_kv, topk_locs)
    truth = truth_rows(case, pool, current_kv)
    token_req = [r for r in range(case.num_requests) for _ in range(case.extend_lens[r])]
    wrong = []
    for t, r in enumerate(token_req):
        for col, p in enumerate(topk_positions[t].tolist()):
            if p < 0:
                continue
            d = int(remapped[t, col])
            if d < 0 or not same_bytes(dense[d], truth[r][p]):
                wrong.append((t, r, p))
    return wrong
