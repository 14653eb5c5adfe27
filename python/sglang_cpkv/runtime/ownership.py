"""Which CP rank owns a page, and where the page lives in its owner's pool: the mode's two placement rules.

A page id is owned by CP rank ``page_id % cp_size`` (contract, "Ownership"; the rule upstream's
kv-sharding and its P/D filters use too), and it is that rank's pool page ``page_id // cp_size``
(contract, "owner pool page"): the page ids are upstream's ``PageInterleavePoolAllocator``'s, which numbers
``cp_size`` x one rank's pool pages, so each rank's pool holds only the pages it owns and the node holds
``cp_size`` times the KV of one pool. Page ids stay global (the same number on every rank); only a pool is
addressed by owner pool pages. Everything that asks "is this page mine" or "where is it in my pool" - the
plan's owned writes and history exchange, the P/D owned-page send - calls :func:`page_owner` and
:func:`owner_pool_page`. At ``cp_size = 1`` the pool page is the page id.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def page_owner(page_ids: T, cp_size: int) -> T:
    """The owning CP rank of each page id (an int, a torch tensor or a numpy array of them)."""
    return page_ids % cp_size


def owner_pool_page(page_ids: T, cp_size: int) -> T:
    """The page of each page id in its owner's pool (same types as :func:`page_owner`)."""
    return page_ids // cp_size


def owner_pool_loc(locs: T, page_size: int, cp_size: int) -> T:
    """A token location (``page_id * page_size + offset``) as a row of its owner's pool (same types)."""
    return owner_pool_page(locs // page_size, cp_size) * page_size + locs % page_size


def pool_pages_per_rank(capacity: int, cp_size: int) -> int:
    """Pages of one rank's pool for ``capacity`` page ids (``capacity`` a multiple of ``cp_size``)."""
    return capacity // cp_size
