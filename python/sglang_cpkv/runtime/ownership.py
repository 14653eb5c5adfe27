"""Which CP rank owns a page: the one ownership rule of the CP shared-KV mode.

A page id is owned by CP rank ``page_id % cp_size`` (contract, "Ownership"; the rule upstream's
kv-sharding and its P/D filters use too). The owner persists the page's rows and serves it to the
other ranks; page ids stay global (the same number on every rank). Everything that asks "is this
page mine" - the plan's owned writes and history exchange, the P/D owned-page send - calls
:func:`page_owner`.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def page_owner(page_ids: T, cp_size: int) -> T:
    """The owning CP rank of each page id (an int, a torch tensor or a numpy array of them)."""
    return page_ids % cp_size
