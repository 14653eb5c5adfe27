"""The soak's invariants on a prefill rank: after every iteration of upstream's loop, and at the end.

After each iteration that ran a batch (:meth:`IterationChecker.after_iteration`): the pages of the rank's pool that hold live KV (the
radix tree's nodes, the requests in flight) hold, at their owner pool rows, the rows the function gives for their
token prefixes (a rank that wrote a page it does not own, a stale page, a load-back into another owner's page id show
here even before a read meets them); the batch's dense KV fits what start-up reserved. Upstream's own memory check runs
where upstream runs it (``on_idle`` when the server is idle, strict: a leak raises). At the end
(:meth:`IterationChecker.final`): every request ended, upstream's memory check at idle, then, with the radix cache
emptied, the allocator's free pages equal its total (no page leaked, none freed twice) and every request row is free.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_cpkv.soak import kv_function


def drained_allocator(s: Any) -> tuple[int, int]:
    """``(free, total)`` token slots of the scheduler's allocator once its radix cache is evicted whole (page ids: cp x
    a rank's pool under the mode's page-interleave allocator, every class counted)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    allocator = s.token_to_kv_pool_allocator
    if not getattr(s.tree_cache, "disable", False):
        s.tree_cache.evict(EvictParams(num_tokens=allocator.size))
    aggregate = getattr(allocator, "aggregate_free_size", None)
    free = aggregate() if aggregate is not None else allocator.available_size()
    return int(free), int(allocator.size)


class IterationChecker:
    def __init__(self, scheduler: Any, worker: Any, rank: int) -> None:
        self.s, self.worker, self.rank = scheduler, worker, rank
        self.iterations = 0
        self.audits = 0
        self.max_dense_tokens = 0

    def after_iteration(self, ledger: Any) -> None:
        """After an iteration that ran a batch (the only writer of the pool): the live pages' audit."""
        self.iterations += 1
        if self.s.last_batch is not None:
            self.audit_pool()

    def audit_pool(self) -> None:
        """The live pages' rows on this rank's pool against the function (owned pages only, at owner pool rows)."""
        locs, hashes = self._live_locations()
        if not locs:
            return
        self.audits += 1
        locs_t = torch.tensor(locs, dtype=torch.int64)
        hashes_t = torch.tensor(hashes, dtype=torch.int64)
        pool = self.s.token_to_kv_pool_allocator.get_kvcache()
        cp = self._cp_size()
        page = pool.page_size
        if cp > 1:
            owned = (locs_t // page) % cp == self.rank
            locs_t, hashes_t = locs_t[owned], hashes_t[owned]
            rows = (locs_t // page // cp) * page + locs_t % page
        else:
            rows = locs_t
        checks = self.worker.checks
        for layer in range(len(pool.kv_buffer)):
            buffer = pool.kv_buffer[layer]
            got = buffer.reshape(buffer.shape[0], -1).view(torch.uint8)[rows.to(buffer.device)].cpu()
            want = self.worker.expected.pool_rows(hashes_t, layer)
            bad = (got != want).any(dim=1)
            checks.pool_rows_checked += int(rows.numel())
            for i in bad.nonzero().flatten().tolist()[:3]:
                checks.mismatch(kind="pool row", location=int(locs_t[i]), layer=layer, iteration=self.iterations)
            if bool(bad.any()):
                checks.mismatches += max(0, int(bad.sum()) - 3)

    def _cp_size(self) -> int:
        from sglang_cpkv.hooks import state

        config = state.current().config
        return config.reservation.cp_size if config is not None and state.current().allocator_cp else 1

    def _live_locations(self) -> tuple[list[int], list[int]]:
        """Token locations that hold KV now, with the hash of the prefix each holds: the radix tree's nodes and the
        requests in flight whose rows the loop has written (the chunked request's history, the transfer queue's)."""
        locs: list[int] = []
        hashes: list[int] = []
        for tokens, values in self._tree_paths():
            hs = kv_function.prefix_hashes(tokens)
            locs += values
            hashes += hs
        s = self.s
        reqs = list(s.disagg_prefill_inflight_queue)
        if s.chunked_req is not None:
            reqs.append(s.chunked_req)
        table = s.req_to_token_pool.req_to_token
        for req in reqs:
            if req.kv.req_pool_idx is None:
                continue
            n = min(len(req.origin_input_ids), int(req.prefix_len))
            if n <= 0:
                continue
            hs = kv_function.prefix_hashes(req.origin_input_ids[:n])
            locs += table[req.kv.req_pool_idx, :n].tolist()
            hashes += hs
        return locs, hashes

    def _tree_paths(self):
        """``(tokens of the path from the root, locations of the node)`` for every node of the radix tree."""
        cache = self.s.tree_cache
        if getattr(cache, "disable", False):
            return
        core = getattr(cache, "tree_core", None)
        root = getattr(cache, "root_node", None) or (core.root if core is not None else None)
        if root is None:
            return
        stack = [(root, [])]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                key = list(child.key.token_ids if hasattr(child.key, "token_ids") else child.key)
                tokens = prefix + key
                value = getattr(child, "value", None)
                if value is not None and len(value) == len(key):
                    yield tokens, value.tolist()
                stack.append((child, tokens))

    def final(self, ledger: Any) -> dict:
        """The end state (module docstring)."""
        s = self.s
        self.audit_pool()
        result = {"audits": self.audits}
        has_leak, messages = s.invariant_checker._check_all_pools(s.pool_stats_observer.get_pool_stats())
        s.invariant_checker._check_req_pool()
        result["memory_check_at_idle"] = "leak: " + "; ".join(messages) if has_leak else "ok"
        result["allocator_free_after_drain"], result["allocator_total"] = drained_allocator(s)
        result["request_rows_free"] = len(s.req_to_token_pool.free_slots)
        result["request_rows_total"] = int(s.req_to_token_pool.size)
        return result
