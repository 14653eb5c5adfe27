"""Which pool rows a CP rank writes in CP shared-KV mode (the seed's compute-padding fix, for 0.5.23).

In 0.5.23 the cache write sees the all-gathered chunk (``N = sum(extend_lens)`` rows in token order) while padding
exists only in each rank's compute rows, so a rank's owned rows (``page_id % cp == cp_rank``) come from every rank's:
the selection is the plan's ``owned_cache_write_locs``, and a write handed this rank's padded compute rows is refused
naming both counts. Rows this rank does not own go to upstream's reserved location 0, which its MLA write kernel
skips (fixed size, no host sync). Used by the DSA hooks (:mod:`.dsa_latent`, :mod:`.dsa_index_k`, :mod:`.dsa_batch`);
design: ``docs/design/cp-shared-kv.md`` section 5, and the contract's "CP".
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
