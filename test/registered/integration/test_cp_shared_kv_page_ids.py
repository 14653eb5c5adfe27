"""The mode's page ids are upstream's page-interleave allocator's, built through upstream's own objects (CPU).

Each case resolves a real ``ServerArgs`` for the DeepSeek-V3.2 fixture config as a P/D prefill server with DSA
prefill CP 2 (TP 2), publishes it, builds upstream's ``KVCacheConfigurator`` for it
(:func:`sglang_cpkv.capacity.upstream.kv_cache_configurator`, a Hopper device capability), sizes the pool of a
budget and asks the configurator's (patched, ``patches/core/widen-page-ids-under-cp-shared-kv.patch``)
``_build_token_to_kv_pool_allocator`` for the token allocator. Checked:

* with the mode on it is upstream's ``PageInterleavePoolAllocator`` over ``shard_size = attn_cp_size``, what upstream's
  scheduler reads through ``page_interleave_shard_size``; its free page ids are exactly ``[cp, C)`` for
  ``C = page_id_capacity(pool)`` (the ``C`` of the mode's plan, ``hooks/page_ids.py``): ids ``[0, cp)`` reserved,
  class ``r`` holding rank ``r``'s pages ``1 ..`` of its pool;
* with the mode off it is upstream's plain paged allocator (no widening);
* ``page_id_capacity`` refuses a CP pool whose allocator the hook did not build (none, or one of another cp).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="cpkv-cpu")

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

from sglang_cpkv.upstream_import import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

from sglang_cpkv.capacity.upstream import (  # noqa: E402
    kv_cache_configurator,
    playing_gpu,
    prefill_cp_server,
    resolve_and_publish,
    token_allocator,
)
from sglang_cpkv.hooks import page_ids as page_id_hooks  # noqa: E402
from sglang_cpkv.hooks import state  # noqa: E402
from sglang_cpkv.hooks.reservation import publish  # noqa: E402
from sglang_cpkv.ops.errors import CpSharedKvError  # noqa: E402
from sglang_cpkv.testing.dsa_kit import kit_reservation  # noqa: E402
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: context per test)

MODEL_DIR = Path(__file__).resolve().parents[1] / "upstream" / "fixtures" / "dsa_v32"  # DeepseekV32ForCausalLM
CP = 2
BUDGET = 8 * 2**30
LAYERS = 4


def _allocator(mode_on: bool):
    """``(allocator, the pool it was built for, attn_cp_size)`` of a CP-2 prefill server, the mode as asked."""
    from sglang.srt.runtime_context import get_parallel, get_schedule

    server = prefill_cp_server(str(MODEL_DIR), tp_size=CP, enable_cp_shared_kv=mode_on)
    with playing_gpu((9, 0)):
        args = resolve_and_publish(server)
        assert bool(args.enable_cp_shared_kv) is mode_on
        page_size = get_schedule().page_size
        kvc = kv_cache_configurator(args, layers=LAYERS, page_size=page_size)
        sizes = kvc._derive_pool_sizes(config=kvc.config_from_budget(BUDGET))
        pool = SimpleNamespace(size=sizes.max_total_num_tokens, page_size=page_size)  # the pool the allocator serves
        allocator = token_allocator(kvc, sizes, pool)
    return allocator, pool, get_parallel().attn_cp_size


def test_mode_on_builds_upstreams_page_interleave_allocator_over_the_cp_ranks(monkeypatch):
    from sglang.srt.mem_cache.allocator.page_interleave import (
        PageInterleavePoolAllocator,
        page_interleave_shard_size,
    )

    state.current().allocator_cp = None
    allocator, pool, cp = _allocator(True)
    assert cp == CP
    assert type(allocator) is PageInterleavePoolAllocator
    assert allocator.shard_size == cp and page_interleave_shard_size(allocator) == cp  # what the scheduler reads
    assert allocator.get_kvcache() is pool and allocator.shard_spec is None  # the mode's buffers are its reservation
    assert allocator.page_size == pool.page_size == 64  # the physical page: every scheduler seam's quantum
    assert state.current().allocator_cp == cp

    # The plan's C is the allocator's page-id space: its free ids are [cp, C), the first cp reserved.
    capacity = page_id_hooks.page_id_capacity(pool)
    assert capacity == cp * (pool.size + pool.page_size) // pool.page_size
    free = torch.sort(allocator.get_all_free_pages()).values
    assert torch.equal(free, torch.arange(cp, capacity))
    assert allocator.available_size() == allocator.aggregate_free_size() == (capacity - cp) * pool.page_size
    pool_pages = capacity // cp
    for rank, pages in enumerate(allocator.class_free_pages):
        # Class r is rank r's pool pages 1 .. pool_pages - 1 (pool page 0 reserved), as page ids q * cp + r.
        assert torch.equal(pages, torch.arange(1, pool_pages) * cp + rank)


def test_mode_off_keeps_upstreams_paged_allocator(monkeypatch):
    from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    state.current().allocator_cp = None
    allocator, pool, cp = _allocator(False)
    assert cp == CP
    assert type(allocator) is PagedTokenToKVPoolAllocator
    assert page_interleave_shard_size(allocator) == 1
    assert allocator.num_pages == pool.size // pool.page_size
    assert state.current().allocator_cp is None


def test_page_id_capacity_refuses_a_cp_pool_without_the_allocator(monkeypatch):
    """``C`` comes from the mode's configuration (its CP size, published where the pool was sized) and the
    allocator the mode built; a batch hook before the reservation is refused, naming the patch that reserves."""
    pool = SimpleNamespace(size=15 * 64, page_size=64)
    state.current().config = None
    with pytest.raises(CpSharedKvError, match="buffers were not reserved at start-up"):
        page_id_hooks.page_id_capacity(pool)
    publish(kit_reservation(2, 128, CP, latent_token_bytes=656, index_k_token_bytes=132))
    state.current().allocator_cp = None
    with pytest.raises(CpSharedKvError, match=f"at cp {CP} needs the token allocator .* and none was built"):
        page_id_hooks.page_id_capacity(pool)
    state.current().allocator_cp = 4
    with pytest.raises(CpSharedKvError, match="one was built for cp 4"):
        page_id_hooks.page_id_capacity(pool)
    state.current().allocator_cp = CP
    assert page_id_hooks.page_id_capacity(pool) == CP * 16
    publish(kit_reservation(2, 128, 1, latent_token_bytes=656, index_k_token_bytes=132))
    state.current().allocator_cp = None
    assert page_id_hooks.page_id_capacity(pool) == 16  # cp 1: the pool's own pages, no allocator needed


def test_an_eagle_draft_builds_its_own_pool_over_the_targets_page_ids(monkeypatch):
    """The MTP draft worker shares the target's token allocator and builds a KV pool of its own (upstream's
    ``_build_token_to_kv_pool`` of a draft configurator, after the target's pool and allocator): under the mode a
    plain DSA pool of the target's rows, owner-sharded by the same page ids, so the plan's ``C`` is the target's.
    Upstream's kv-sharding branch for drafts (``get_shared_kv_shard_pool``) must not take the mode's allocator for
    kv-sharding's: it refused it ("A sharded MTP draft requires the target's sharded KV pool"), so no server of the
    mode with a draft started."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
    from sglang.srt.runtime_context import get_schedule

    state.current().allocator_cp = None
    monkeypatch.setenv("SGLANG_CP_DRAFT_SHARED_KV", "1")
    server = prefill_cp_server(str(MODEL_DIR), tp_size=CP, enable_cp_shared_kv=True, speculative_algorithm="EAGLE")
    with playing_gpu((9, 0)):
        args = resolve_and_publish(server)
        page_size = get_schedule().page_size
        target = kv_cache_configurator(args, layers=LAYERS, page_size=page_size)
        sizes = target._derive_pool_sizes(config=target.config_from_budget(2**30))
        target.device = "cpu"
        requests = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
        target_pool = target._build_token_to_kv_pool(
            sizes=sizes, is_dsa_model=True, is_dsv4_model=False, req_to_token_pool=requests
        )
        allocator = token_allocator(target, sizes, target_pool)
        draft = kv_cache_configurator(args, layers=1, page_size=page_size, draft_worker=True)
        draft.device, draft.token_to_kv_pool_allocator = "cpu", allocator
        draft_pool = draft._build_token_to_kv_pool(
            sizes=sizes, is_dsa_model=True, is_dsv4_model=False, req_to_token_pool=requests
        )
    assert type(target_pool) is type(draft_pool) is DSATokenToKVPool
    assert draft_pool.size == target_pool.size and draft_pool.layer_num == 1 and draft_pool.start_layer == 0
    assert (
        page_id_hooks.page_id_capacity(draft_pool)
        == page_id_hooks.page_id_capacity(target_pool)
        == (CP * (target_pool.size + page_size) // page_size)
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
