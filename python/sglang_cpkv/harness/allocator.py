"""A paged KV allocator with a radix-style prefix cache, in the two modes the contract tells apart.

* ``share_partial_pages=False`` (**reachable in upstream 0.5.23**): the prefix cache matches whole
  pages only (a prompt reuses the pages of the longest cached page-aligned prefix, leaving at least
  one token to compute); the rest of the prompt, a partial tail included, gets fresh pages, so
  current tokens land in fresh pages or continue the request's *own* partial page.
* ``share_partial_pages=True`` (**collision class**, the seed fork's state): the cache also matches a
  cached prompt ending mid-page, and the request continues that *shared, partially filled* page
  with its own current tokens, so two requests of a batch write different rows at one pool
  location.

:meth:`PrefixCachingAllocator.admit` can also hand out, as a request's first fresh page, a page id
that another request of the batch holds (``reuse_page``): the "page id reused within a batch"
state (rank-local page maps, a page freed and reallocated under a live batch), also collision class.

Page 0 is reserved (upstream's padding page); the free list is shuffled with a seed so that page
ids, and hence their CP owners (``page_id % cp``), are irregular.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """A request's pages: ``pages`` covers the whole prompt; the first ``cached_len`` tokens are in the pool."""

    pages: tuple[int, ...]
    cached_len: int


class PrefixCachingAllocator:
    """Pages of one pool of ``capacity`` page ids, with a prefix cache keyed by token prefixes."""

    def __init__(self, capacity: int, page_size: int, *, share_partial_pages: bool, seed: int) -> None:
        self.capacity = capacity
        self.page_size = page_size
        self.share_partial_pages = share_partial_pages
        self._free = list(range(1, capacity))
        random.Random(seed).shuffle(self._free)
        # token prefix -> the pages holding it (the last one partial when share_partial_pages)
        self._cache: dict[tuple[int, ...], tuple[int, ...]] = {}

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match(self, tokens: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """``(cached_len, pages)`` of the longest cached prefix of ``tokens`` shorter than ``tokens``."""
        for length in range(len(tokens) - 1, 0, -1):
            if not self.share_partial_pages and length % self.page_size:
                continue
            pages = self._cache.get(tokens[:length])
            if pages is not None:
                return length, pages[: self._pages_for(length)]
        return 0, ()

    def admit(self, tokens: tuple[int, ...], reuse_page: int | None = None) -> Admission:
        """Pages for a prompt: the cached prefix's pages, then fresh ones.

        Args:
            reuse_page: hand out this (already used) page id as the first fresh page instead of
                a free one (collision class).

        Raises:
            RuntimeError: the pool has no free page left (``capacity`` too small).
        """
        cached_len, shared = self.match(tokens)
        fresh_needed = self._pages_for(len(tokens)) - len(shared)
        fresh: list[int] = []
        if reuse_page is not None and fresh_needed:
            fresh.append(reuse_page)
        while len(fresh) < fresh_needed:
            if not self._free:
                raise RuntimeError(f"allocator: no free page left among {self.capacity} page ids")
            fresh.append(self._free.pop())
        return Admission(shared + tuple(fresh), cached_len)

    def insert(self, tokens: tuple[int, ...], pages: tuple[int, ...]) -> None:
        """Cache a finished prompt: its whole-page prefixes (and, sharing partial pages, the whole prompt).

        An already cached prefix keeps its pages (the first request that computed it owns them).
        """
        lengths = list(range(self.page_size, len(tokens) + 1, self.page_size))
        if self.share_partial_pages and len(tokens) % self.page_size:
            lengths.append(len(tokens))
        for length in lengths:
            self._cache.setdefault(tokens[:length], pages[: self._pages_for(length)])
