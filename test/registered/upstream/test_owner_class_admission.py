"""Prefill admission on a page-interleave pool with free pages uneven over its owner classes (upstream-findings item 5).

``patches/upstream-fixes/admit-on-owner-class-floors.patch``: upstream's admission compares a request with the pool's
min-class free floor plus the evictable tokens of every class, which under-counts what eviction frees (a prompt the
pool can serve waits at the head of the queue forever: nothing evicts until a request is admitted) and over-counts
when the short class's pages are locked (admitted, then the allocation fails). Upstream's objects on CPU, as
``Scheduler._get_new_batch_prefill_raw`` drives them: a resolved P/D prefill ``ServerArgs`` (cp 2, the GLM-5 DSA
config), upstream's ``PageInterleavePoolAllocator`` (built as ``--enable-kv-cache-sharding`` builds it, and through
the mode's hook), ``UnifiedRadixCache`` and ``PrefillAdder``; P/D prefill requests (``max_new_tokens`` 1). On the
pristine tree the first two tests fail (NO_TOKEN on every pass; admitted and then not allocatable).
"""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

import pytest
import torch

from sglang_cpkv.upstream_import import install_torchvision_stub

install_torchvision_stub()

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.runtime_context import get_schedule  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_cpkv.capacity.upstream import prefill_cp_server  # noqa: E402
from sglang_cpkv.hooks import page_ids as page_id_hooks  # noqa: E402
from sglang_cpkv.hooks import state  # noqa: E402
from sglang_cpkv.runtime.reservation import Reservation  # noqa: E402
from sglang_cpkv.testing.ci_register import register_cpu_ci  # noqa: E402
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse)
from sglang_cpkv.testing.prefill_admission import AdmissionWorld  # noqa: E402

register_cpu_ci(est_time=30, suite="cpkv-cpu")

GLM5_DIR = Path(__file__).parent / "fixtures" / "glm5_dsa"
PAGE, CP, CHUNK, VOCAB = 64, 2, 256, 154880
PAGES_PER_RANK = 40  # a node: CP x 40 pages = 5120 token locations
SERVER = prefill_cp_server(str(GLM5_DIR), chunked_prefill_size=CHUNK, tp_size=CP, attn_cp_size=CP)


@pytest.fixture(autouse=True)
def no_reservation():
    with state.scoped():
        yield


class World(AdmissionWorld):
    """The server's objects (``testing/prefill_admission.py``); mode off: ``--enable-kv-cache-sharding``'s allocator."""

    def __init__(self, monkeypatch, mode_on: bool, chunk: int = CHUNK):
        super().__init__(
            monkeypatch,
            {**SERVER, "chunked_prefill_size": chunk},
            mode_on=mode_on,
            pool_tokens=PAGES_PER_RANK * PAGE,
            rows=64,
            max_context=8192,
            reservation=lambda: Reservation(
                max_batch_tokens=8192,
                chunk_tokens=chunk,
                page_size=PAGE,
                cp_size=CP,
                layer_ahead=True,
                latent_token_bytes=656,
                index_k_token_bytes=132,
            ),
            kv_cache_sharding=True,
        )
        assert get_schedule().page_size == PAGE
        assert page_id_hooks.widens_page_ids() == mode_on

    def prefill_pass(self, waiting):
        """One pass of the scheduler's waiting-queue loop, then the admission locks given back (a test pass)."""
        adder, results = super().prefill_pass(waiting)
        for req in adder.can_run_list:
            self.tree_cache.unlock(req.lock)
        return adder, results

    def serve_and_cache(self, tokens):
        """A request prefilled and cached as the scheduler does: radix match, rotation base from req.last_node
        (_kv_shard_rotation_bases), upstream's alloc_extend, insert with the resolved base; KV released (evictable)."""
        req = make_req(f"c{tokens[-1]}", tokens)
        req.init_next_round_input(self.tree_cache)
        prefix = req.prefix_len
        prefix_locs = (
            self.tree_cache.path_device_indices(req.last_node) if prefix else torch.empty(0, dtype=torch.int64)
        )
        bases = [self.tree_cache.rotation_base_of(req.last_node) if prefix else None]
        t = lambda n: torch.tensor([n])  # noqa: E731
        locs = self.allocator.alloc_extend(
            t(prefix),
            t(prefix),
            t(len(tokens)),
            t(len(tokens)),
            t(int(prefix_locs[-1]) if prefix else -1),
            len(tokens) - prefix,
            rotation_bases=bases,
        )
        assert locs is not None
        self.tree_cache.insert(
            InsertParams(
                key=RadixKey(array("q", tokens)),
                value=torch.cat((prefix_locs, locs)),
                rotation_base=bases[0],
                prev_prefix_len=prefix,
            )
        )  # cache_protected_len

    def snapshot(self):
        a = self.allocator
        return a.class_free_page_counts(), a.available_size(), self.tree_cache.evictable_size()


def make_req(rid, tokens):
    sp = SamplingParams(max_new_tokens=1, temperature=0.0)  # P/D prefill sets max_new_tokens = 1
    sp.normalize(None)
    sp.verify(VOCAB)
    return Req(rid, "", array("q", tokens), sp)


def skew_by_conversations(world, system_pages, conversations, first=10_000):
    """A system prompt and one-page messages on it (the soak's workload: a new conversation extends a system prompt):
    every message page continues the system chain's rotation, so all land in ONE owner class."""
    system = list(range(first, first + system_pages * PAGE))
    world.serve_and_cache(system)
    for i in range(conversations):
        world.serve_and_cache(system + list(range(first + 100_000 * (i + 1), first + 100_000 * (i + 1) + PAGE)))


def alloc_directly(world, n_tokens):
    """What the allocation path would do with the request: evict_to_free_tokens (LRU until the min-class floor holds
    the conservative demand), then alloc_extend. Returns the locs or None."""
    world.allocator.evict_to_free_tokens(world.tree_cache, n_tokens + CP * PAGE)
    t = lambda n: torch.tensor([n])  # noqa: E731
    return world.allocator.alloc_extend(t(0), t(0), t(n_tokens), t(n_tokens), t(-1), n_tokens, rotation_bases=[None])


@pytest.mark.parametrize("mode_on", [False, True], ids=["kv-cache-sharding", "cp-shared-kv"])
def test_a_prompt_eviction_makes_room_for_is_admitted_on_the_first_pass(monkeypatch, mode_on):
    world = World(monkeypatch, mode_on)
    skew_by_conversations(world, system_pages=1, conversations=30)
    free, floor, evictable = world.snapshot()
    assert free == [39, 10] and evictable == 31 * PAGE  # class 1 holds every message page
    big = make_req("big", list(range(900_000, 900_000 + 3300)))  # 52 pages: 26 of each class once evicted
    assert floor + evictable <= 3300 + 1 + CP * PAGE  # upstream's figure defers it, on every pass (pristine)
    adder, results = world.prefill_pass([big])
    assert [r.rid for r in adder.can_run_list] == ["big"], results
    assert alloc_directly(world, 3300).numel() == 3300  # and the allocation serves it


def test_a_short_class_that_eviction_cannot_free_defers_the_request(monkeypatch):
    """Class-1 pages locked (transfers in flight hold their requests' tree locks), class-0 pages evictable: upstream
    counts class-0 pages toward class 1, admits, and the allocation fails after evicting everything."""
    world = World(monkeypatch, mode_on=True, chunk=8192)  # the whole prompt is one chunk (one allocation)
    skew_by_conversations(world, system_pages=1, conversations=24)
    for i in range(24):
        r = make_req(
            f"l{i}",
            list(range(10_000, 10_000 + PAGE))
            + list(range(10_000 + 100_000 * (i + 1), 10_000 + 100_000 * (i + 1) + PAGE))
            + [7],
        )
        r.init_next_round_input(world.tree_cache)
        assert r.prefix_len == 2 * PAGE
        world.tree_cache.lock(r.last_node)
    skew_by_conversations(world, system_pages=2, conversations=20, first=20_000)
    free, floor, evictable = world.snapshot()
    length = 2 * (free[1] + 2) * PAGE  # needs free[1] + 2 class-1 pages; class 1 can reach free[1] + 1
    assert length + 1 + CP * PAGE < floor + evictable  # upstream's figure admits it (pristine)
    adder, results = world.prefill_pass([make_req("big", list(range(900_000, 900_000 + length)))])
    assert results == {"big": AddReqResult.NO_TOKEN} and adder.can_run_list == []
    assert alloc_directly(world, length) is None  # what admitting it would have led to


def test_a_pool_without_skew_is_neither_evicted_nor_admitted_differently(monkeypatch):
    world = World(monkeypatch, mode_on=True)
    for i in range(15):  # new chains start on the least-full class: balanced
        world.serve_and_cache(list(range(300_000 + 1000 * i, 300_000 + 1000 * i + 2 * PAGE)))
    before = world.snapshot()
    adder, _ = world.prefill_pass([make_req("small", list(range(900_000, 900_000 + 500)))])
    assert [r.rid for r in adder.can_run_list] == ["small"] and world.snapshot() == before


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
