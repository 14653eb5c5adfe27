"""Prefill admission on a page-interleave pool: admit what eviction makes allocatable, defer what it cannot.

Called by ``patches/upstream-fixes/admit-on-owner-class-floors.patch`` (``PageInterleavePoolAllocator.
create_prefill_budget``, the capacity hook upstream's allocators override). Upstream's ``PrefillBudget`` admits when
``total_tokens < available_size() + evictable_size()``: the pool's free floor (N x page x the free pages of its
emptiest owner class) plus the cache's evictable tokens counted over every class. With free pages spread unevenly
over the classes that figure is wrong both ways (``docs/upstream-findings.md`` item 5): it under-counts what eviction
frees (the skew is subtracted, down to capacity / N), and since nothing evicts until a request is admitted, a prompt
the pool can serve waits at the head of the queue forever; and it over-counts when the short class's pages are locked
(evicting other classes' pages does not help it), so a request is admitted that the allocation cannot serve.
"""

from __future__ import annotations

import functools
from typing import Any


def owner_class_prefill_budget(allocator: Any, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
    """Upstream's ``PrefillBudget`` whose ``check_prefill`` admits on the realized free floor of every class."""
    return _budget_class()(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)


@functools.cache
def _budget_class() -> type:
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    class OwnerClassPrefillBudget(PrefillBudget):
        def check_prefill(self, *, total_tokens: int, chunk_limit: int | None, **_: Any) -> tuple[bool, int | None]:
            # Upstream's condition (total_tokens < remaining_total), with the floor made real: evict (LRU, as the
            # allocation would; the candidate's prefix is locked) until every class can serve its share.
            need = self.total_offset + total_tokens + 1
            if self.allocator.available_size() < need:
                self.allocator.evict_to_free_tokens(self.tree_cache, need)
            return (True, chunk_limit) if self.allocator.available_size() >= need else (False, None)

    return OwnerClassPrefillBudget
