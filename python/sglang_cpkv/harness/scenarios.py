"""The harness scenarios: prompts with shared prefixes and per-request markers, and how they are allocated.

Token ids: shared prefixes and branches draw from ``[1, MARKER_BASE)``; request ``r``'s own suffix
(its **markers**) uses ids ``MARKER_BASE + MARKERS_PER_REQUEST * r + i``, distinct from every other
request's, so the KV rows at its suffix positions are that request's alone. Seeing one of them in
another request's reads is contamination.

Scenarios (``ps`` = page size; the state class is also recomputed from each forward's page tables,
:func:`sglang_cpkv.testing.batches.BatchCase.state_class`):

* ``radix`` (**reachable**): a radix tree of cached prompts, a shared prefix of ``2 ps + 2`` tokens
  and two branches of it; request ``r`` takes the bare prefix, branch 0, branch 1, or no shared
  prefix (``r % 4``), then its markers. Whole-page matches only: the prefix's partial tail is
  recomputed in the request's own page. Chunked prefill of ``ps + 1`` tokens per forward, so
  every later chunk continues the request's own partial page (CURRENT_REUSE).
* ``collision_partial`` (**collision**): the cache also shares the prefix's partially filled last
  page; every request continues that shared page with its own markers (one forward: the shared
  page's pool rows are ambiguous afterwards, so nothing reads them later).
* ``collision_reuse`` (**collision**): even requests reuse the cached two-page prefix; odd requests
  have no shared prefix, and the allocator hands each of them the prefix's *second* page (a history
  page of the even requests) as its first fresh page: a page id reused within the batch. One forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sglang_cpkv.testing.batches import COLLISION, REACHABLE

MARKER_BASE = 128
MARKERS_PER_REQUEST = 16
SCENARIO_NAMES = ("radix", "collision_partial", "collision_reuse")


@dataclass(frozen=True)
class Scenario:
    """One scenario: prompts (request ``r`` is ``prompts[r]``) and the allocator that serves them.

    Attributes:
        name, expected_class: the scenario and the contract's state class it is built to reach
            (:data:`REACHABLE` or :data:`COLLISION`).
        page_size, capacity: the pool.
        warmups: prompts run first, one at a time, to fill the prefix cache.
        prompts: the batch's requests (a batch of ``bs`` takes the first ``bs``).
        marker_start: per request, the first position of its own suffix (its markers).
        chunk_size: tokens per request per forward in the batch run (None: the whole rest at once).
        share_partial_pages: the allocator mode (:mod:`.allocator`).
        reuse_history_page: per request, whether its first fresh page is the cached prefix's
            second page (``collision_reuse``).
    """

    name: str
    expected_class: str
    page_size: int
    capacity: int
    warmups: tuple[tuple[int, ...], ...]
    prompts: tuple[tuple[int, ...], ...]
    marker_start: tuple[int, ...]
    chunk_size: int | None
    share_partial_pages: bool
    reuse_history_page: tuple[bool, ...]

    @property
    def golden_chunk_size(self) -> int:
        """Chunk size of the bs=1 golden runs (always chunked, mid-page)."""
        return self.page_size + 1


def _markers(r: int, count: int) -> tuple[int, ...]:
    if count > MARKERS_PER_REQUEST:
        raise ValueError(f"{count} markers per request > MARKERS_PER_REQUEST={MARKERS_PER_REQUEST}")
    return tuple(MARKER_BASE + MARKERS_PER_REQUEST * r + i for i in range(count))


def build_scenarios(num_requests: int, page_size: int, seed: int = 0) -> dict[str, Scenario]:
    """Every scenario of the module docstring with ``num_requests`` prompts (the largest bs)."""
    if (MARKERS_PER_REQUEST * num_requests) + MARKER_BASE > 256:
        raise ValueError(f"num_requests={num_requests}: markers would leave the vocabulary of 256 tokens")
    if page_size + 5 > MARKERS_PER_REQUEST:
        raise ValueError(f"page_size={page_size} too large for {MARKERS_PER_REQUEST} marker tokens per request")
    rng = random.Random(seed)

    def shared_tokens(count: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, MARKER_BASE) for _ in range(count))

    ps = page_size
    prefix = shared_tokens(2 * ps + 2)
    branches = (prefix + shared_tokens(ps), prefix + shared_tokens(ps))
    suffix_len = [ps + 3 + r % 3 for r in range(num_requests)]

    def capacity(prompts, warmups) -> int:
        return sum(-(-len(p) // ps) for p in (*prompts, *warmups)) + 2

    scenarios = {}
    # radix: r % 4 -> bare prefix, branch 0, branch 1, no shared prefix.
    heads = [(prefix, branches[0], branches[1], ())[r % 4] for r in range(num_requests)]
    prompts = tuple(h + _markers(r, suffix_len[r]) for r, h in enumerate(heads))
    warmups = (prefix, branches[0], branches[1])
    scenarios["radix"] = Scenario(
        "radix",
        REACHABLE,
        ps,
        capacity(prompts, warmups),
        warmups,
        prompts,
        tuple(len(h) for h in heads),
        ps + 1,
        False,
        (False,) * num_requests,
    )
    prompts = tuple(prefix + _markers(r, suffix_len[r]) for r in range(num_requests))
    scenarios["collision_partial"] = Scenario(
        "collision_partial",
        COLLISION,
        ps,
        capacity(prompts, (prefix,)),
        (prefix,),
        prompts,
        (len(prefix),) * num_requests,
        None,
        True,
        (False,) * num_requests,
    )
    # even: the page-aligned prefix + markers; odd: markers only, first page = the prefix's page 1.
    aligned = prefix[: 2 * ps]
    heads = [aligned if r % 2 == 0 else () for r in range(num_requests)]
    prompts = tuple(h + _markers(r, suffix_len[r]) for r, h in enumerate(heads))
    scenarios["collision_reuse"] = Scenario(
        "collision_reuse",
        COLLISION,
        ps,
        capacity(prompts, (aligned,)),
        (aligned,),
        prompts,
        tuple(len(h) for h in heads),
        None,
        False,
        tuple(r % 2 == 1 for r in range(num_requests)),
    )
    return scenarios
