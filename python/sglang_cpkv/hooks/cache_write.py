"""Which pool rows a CP rank writes in CP shared-KV mode (the seed's compute-padding fix, for 0.5.23).

The seed's bug: under CP with CURRENT_REUSE the current KV reached the cache write already
all-gathered to the global chunk (512 rows), while the padding branch selected rows by this rank's
*compute* rows (64 expected) - a shape mismatch, fixed in the seed by re-localizing the KV first
(``cp_localize_current_kv_to_compute_rows``).

In 0.5.23 the cache write always sees the all-gathered chunk: ``N = sum(extend_lens)`` rows in
token order, with ``out_cache_loc`` cut to ``N`` (``srt/layers/cp/utils.py:182``); padding exists
only in each rank's local compute rows (``pad_logical_token_to_physical``: ``physical =
roundup(max logical, cp)`` rows per rank, padding last). In CP shared-KV mode a rank persists the
rows of the pages it *owns* (``page_id % cp == cp_rank``), and those rows come from every rank's
compute rows, so the selection cannot be derived from this rank's compute rows at all: it is the
plan's ``owned_cache_write_locs`` (token order, built once per batch from the split plan), and a
write handed this rank's padded compute rows is refused with both row counts named.

Rows this rank does not own are sent to upstream's reserved location 0 ("the padded slot 0 is used
for writing dummy outputs from padded tokens", ``MLATokenToKVPool._create_buffers``); upstream's
MLA write kernel skips it (``reserved_skip_index=0`` in ``set_mla_kv_buffer_kernel``), and page 0
is never handed to a request. This keeps the write fixed-size (no host sync to count owned rows).
"""

from __future__ import annotations

import torch

from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime.plan import CpSharedKvPlan

RESERVED_SKIP_LOC = 0


def owned_pool_write_locs(plan: CpSharedKvPlan) -> torch.Tensor:
    """``[N]`` pool locations for upstream's cache writes of the all-gathered current chunk.

    Row ``t`` (token order) keeps ``out_cache_loc[t]`` when this rank owns its page, else
    :data:`RESERVED_SKIP_LOC`. int64. Compute once per batch.
    """
    locs = plan.owned_cache_write_locs
    if plan.cp_size == 1:  # this rank owns every page: no -1 to replace
        return locs
    return torch.where(locs >= 0, locs, RESERVED_SKIP_LOC)


def check_cache_write_rows(plan: CpSharedKvPlan, kv_rows: int, where: str) -> None:
    """Refuse a cache write whose KV is not the all-gathered chunk of ``N`` rows (host ints, free).

    Raises:
        CpSharedKvError: naming the row count, ``N`` and, when it matches, this rank's padded
            compute rows (the seed's 512-vs-64 mismatch, seen from the other side).
    """
    if kv_rows == plan.num_tokens:
        return
    if kv_rows == plan.split.physical_rows:
        raise CpSharedKvError(
            f"{where}: the KV has {kv_rows} rows = this CP rank's padded compute rows "
            f"(logical {plan.split.per_rank_logical[plan.cp_rank]}, physical {plan.split.physical_rows}); "
            f"CP shared-KV persists the rows of owned pages from the all-gathered chunk of N={plan.num_tokens} rows "
            "(token order), which other ranks computed too: all-gather the current KV first"
        )
    raise CpSharedKvError(
        f"{where}: the KV has {kv_rows} rows; the split plan expects the all-gathered chunk of "
        f"N={plan.num_tokens} rows (this rank computes {plan.split.physical_rows} padded rows of "
        f"cp_size={plan.cp_size})"
    )
