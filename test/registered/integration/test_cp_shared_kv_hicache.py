"""HiCache host offload and load-back beside ``--enable-cp-shared-kv``, through upstream's objects, on CPU.

Upstream's DSA kit (:mod:`sglang_cpkv.testing.dsa_kit`) with the mode on, and upstream's HiCache around its pool
(:mod:`sglang_cpkv.testing.hicache_cpu`: the host pool group built by upstream's builder, whose
``build_kv_host_pool`` carries the queue's HiCache patch, and ``HybridCacheController`` with kernel I/O in both host
layouts the mode allows; pinning and the transfer ops stood in on CPU). The scenario, on each rank:

1. batch 1 writes a request's prompt (its first two pages become the prefix);
2. the prefix is backed up to host (``controller.write``; under CP each rank's own rows only), and its pages are
   overwritten, as when they are handed to other requests;
3. the prefix is loaded back (``controller.load``: upstream's allocator picks the page ids, other than before; under
   CP of the owner class of the host copy, as upstream's load always does), its rows landing in the pool layer by
   layer only when a reader awaits that layer (``LayerLoadGate``, the layer counter registered on the pool);
4. batch 2, bs 3: X on the loaded prefix, Y on a history of its own, Z sharing X's loaded prefix.

Every request of batch 2 reads, in every layer, the bytes it reads alone in a fresh world where its history never
left the device (X and Z on the original page ids); the loaded pages hold the original latent and index-K bytes; a
withheld layer stops the forward at the mode's read of it.
"""

import os
import sys
import traceback
from dataclasses import dataclass

import pytest
import torch

from sglang_cpkv.testing.batches import BatchCase, same_bytes
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import (
    PAGE,
    KitRoute,
    KitWorld,
    assert_reads_alone,
    request_reads,
    run_kit_ranks,
)
from sglang_cpkv.testing.hicache_cpu import (
    MEM_LAYOUTS,
    HostTier,
    LayerLoadGate,
    LayerWithheld,
    byte_rows,
    cpu_host_transfers,
)

register_cpu_ci(est_time=125, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

SHAPE = (3, 300)  # requests, longest
INDEX_SHARE = (False, True, False)  # layer 1 reuses layer 0's top-k: no index-K pool
ROUTES = {
    "flashmla_kv-fp8-paged-indexshare": KitRoute("flashmla_kv", fp8=True, skip_topk_layers=INDEX_SHARE),
    "flashmla_sparse-bf16-paged": KitRoute("flashmla_sparse", skip_topk_layers=(False, False)),
}
POISON = 0xA5


def _world(route, **kw):
    return KitWorld(route, max_requests=SHAPE[0], longest=SHAPE[1], mode_on=True, device="cpu", **kw)


def _pages(locs):
    return (locs[::PAGE] // PAGE).tolist()


@dataclass
class Reloaded:
    """One rank's run of the scenario (module docstring)."""

    worlds: list  # the target's, then the draft's when there is one
    case: BatchCase  # batch 2
    runs: list  # batch 2's run of each world
    gate: LayerLoadGate
    before: list[int]  # the prefix's page ids before it left
    after: list[int]  # the page ids it was loaded back into
    saved: list  # per world, this rank's bytes of the prefix before it left (_pool_bytes)
    landed: list  # per world, this rank's bytes of the loaded pages after batch 2
    sharded: bool  # whether the controller moves this rank's owned rows only


def reload_scenario(route, mem_layout, draft=False, write_policy="write_through", **world_kw):
    """Steps 1-4 of the module docstring on one rank; with ``draft``, an MTP draft's world beside the target (its own
    pool of one layer on the same page ids, packed into the target's host transfers as upstream packs a draft's)."""
    worlds = _worlds(route, draft, **world_kw)
    target = worlds[0]
    with cpu_host_transfers() as table:
        tier = HostTier(target, table, mem_layout, write_policy, drafts=worlds[1:])
        prompt = _alloc(tier.allocator, 3 * PAGE)
        for world in worlds:
            world.forward(BatchCase(PAGE, world.capacity, (tuple(_pages(prompt)),), (0,), (170,), world.cp_size))
        prefix = prompt[: 2 * PAGE]
        before = _pages(prefix)
        local = target.pool_rows(prefix[_owned(target, prefix)])
        saved = [_pool_bytes(world.pool, local) for world in worlds]
        host = tier.back_up(prefix, start_owner=before[0] % target.cp_size if tier.sharded else None)
        for world in worlds:  # the pages' next requests write them
            _poison(world.pool, local)
        loaded, gate = tier.load_back(host)
        after = _pages(loaded)
        own = _alloc(tier.allocator, 3 * PAGE)
        current = _alloc(tier.allocator, 2 * PAGE)
        y_alone = BatchCase(PAGE, target.capacity, (tuple(_pages(own)),), (150,), (20,), target.cp_size)
        case = BatchCase(
            PAGE,
            target.capacity,
            (tuple(after + _pages(current)[:1]), tuple(_pages(own)), tuple(after + _pages(current)[1:])),
            (128, 150, 128),
            (50, 20, 30),
            target.cp_size,
        )
        runs = []
        for world in worlds:  # the target's extend, then the draft's of the same batch
            world.write_history(y_alone)
            runs.append(world.forward(case))
        loaded_local = target.pool_rows(loaded[_owned(target, loaded)])
        landed = [_pool_bytes(world.pool, loaded_local) for world in worlds]
    return Reloaded(worlds, case, runs, gate, before, after, saved, landed, tier.sharded)


def _poison(pool, rows):
    for buffer in pool.kv_buffer:
        byte_rows(buffer)[rows] = POISON
    for buffer in pool.index_k_with_scale_buffer:
        if buffer.numel():
            buffer[_pages_of_rows(rows)] = POISON


def _alloc(allocator, tokens):
    """Page-aligned token locations from upstream's allocator; the page-interleave one (cp > 1) draws owner classes in
    rotation from class 0, as a chain whose rotation starts there."""
    if hasattr(allocator, "alloc_cyclic"):
        return allocator.alloc_cyclic(start_class=0, need_size=tokens)
    return allocator.alloc(tokens)


def _owned(world, locs):
    return (locs // PAGE) % world.cp_size == world.cp_rank


def _pages_of_rows(rows):
    return sorted({int(r) // PAGE for r in rows.tolist()})


def _pool_bytes(pool, rows):
    """This rank's pool ``rows`` of the latent pool and their pages of the index-K pool, per layer (None: an IndexShare
    layer)."""
    pages = _pages_of_rows(rows)
    latent = [byte_rows(buffer)[rows].clone() for buffer in pool.kv_buffer]
    index_k = [buffer[pages].clone() if buffer.numel() else None for buffer in pool.index_k_with_scale_buffer]
    return latent, index_k


def alone_runs(route, reloaded, **world_kw):
    """Each request of batch 2 run alone (this rank's share), in fresh worlds where its history is on the page ids it
    had before the offload and never left the device: per world of ``reloaded`` (target, draft), ``[(run, case)]``."""
    case, original = reloaded.case, dict(zip(reloaded.after, reloaded.before))
    runs = [[] for _ in reloaded.worlds]
    for r in range(case.num_requests):
        table = tuple(original.get(p, p) for p in case.page_tables[r])
        solo_case = BatchCase(
            PAGE, case.capacity, (table,), (case.prefix_lens[r],), (case.extend_lens[r],), case.cp_size
        )
        solo = _worlds(route, len(reloaded.worlds) > 1, **world_kw)
        for world, world_runs in zip(solo, runs):
            world.write_history(solo_case)
            world_runs.append((world.forward(solo_case), solo_case))
    return runs


def _worlds(route, draft, **world_kw):
    """The target's world, and an MTP draft's beside it (its own pool of one layer at start layer 0 on the same page
    ids, other weights; the reservation charges both backends, as the target's pool sizing does)."""
    import dataclasses

    from sglang_cpkv.hooks.reservation import publish, published

    worlds = [_world(route, **world_kw)]
    if draft:
        worlds.append(_world(dataclasses.replace(route, skip_topk_layers=(False,)), seed=1, **world_kw))
        publish(dataclasses.replace(published(), backends=2))
    return worlds


def _alone_reads(per_rank_runs, layer):
    """``{(request, position): (valid, rows)}`` of the alone runs, every rank's query rows together."""
    reads = {}
    for r, runs in enumerate(zip(*per_rank_runs)):
        reads.update({(r, p): v for (_, p), v in request_reads(list(runs), layer).items()})
    return reads


def _assert_loaded_as_before(worlds_layers, saved, landed, what):
    for w, layers in enumerate(worlds_layers):
        (saved_latent, saved_index), (landed_latent, landed_index) = saved[w], landed[w]
        for layer in range(layers):
            assert same_bytes(landed_latent[layer], saved_latent[layer]), f"{what} world {w}: latent, layer {layer}"
            if saved_index[layer] is not None:
                assert same_bytes(landed_index[layer], saved_index[layer]), f"{what} world {w}: index K, layer {layer}"


def _assert_read_alone(per_rank_batches, per_rank_alone, worlds_layers, case, what):
    """Each world's batch 2 (every rank's query rows together) reads, in every layer, what each request reads alone."""
    for w, layers in enumerate(worlds_layers):
        for layer in range(layers):
            batch = request_reads([(runs[w], case) for runs in per_rank_batches], layer)
            alone = _alone_reads([alone[w] for alone in per_rank_alone], layer)
            assert_reads_alone(batch, alone, f"{what} world {w} layer {layer}")


# Each route, host layout, history schedule and write policy, and the draft, once (a case runs worlds per request
# alone). The write policy decides when upstream backs a page up, not what moves: each case backs up explicitly.
CASES = [
    ("flashmla_kv-fp8-paged-indexshare", "layer_first", "0", False, "write_through"),
    ("flashmla_kv-fp8-paged-indexshare", "page_first", "1", True, "write_back"),
    ("flashmla_sparse-bf16-paged", "page_first", "0", False, "write_through_selective"),
]
assert {c[1] for c in CASES} == set(MEM_LAYOUTS) and {c[0] for c in CASES} == set(ROUTES)


@pytest.mark.parametrize(
    "route_name, mem_layout, layer_ahead, draft, write_policy",
    CASES,
    ids=[f"{r}-{m}-{'ahead' if a == '1' else 'sync'}{'-draft' if d else ''}-{w}" for r, m, a, d, w in CASES],
)
def test_a_prefix_loaded_back_from_host_reads_as_it_did_before_it_left(
    route_name, mem_layout, layer_ahead, draft, write_policy, monkeypatch
):
    monkeypatch.setenv("SGLANG_CPKV_LAYER_AHEAD", layer_ahead)
    route = ROUTES[route_name]
    got = reload_scenario(route, mem_layout, draft=draft, write_policy=write_policy)
    assert not got.sharded  # at cp 1 the allocator is upstream's paged one: the host pool stays upstream's plain one
    assert not set(got.after) & set(got.before), "upstream's allocator handed the load the pages it had taken away"
    layers = [world.route.num_layers for world in got.worlds]
    _assert_loaded_as_before(layers, got.saved, got.landed, route_name)
    _assert_read_alone([got.runs], [alone_runs(route, got)], layers, got.case, f"{route_name} {mem_layout}")
    # The mode awaited every layer it read (the gate lands a layer's rows only then).
    assert sorted(set(got.gate.awaited)) == list(range(route.num_layers)) and not got.gate.landing


def test_a_withheld_layer_stops_the_modes_read_of_it():
    """A layer whose load has not completed is not read: the mode's history copy waits on the pool's layer counter
    (hooks/hicache.after_layer_load) before it reads the layer, whatever upstream's own readers do (layer 1 is an
    IndexShare layer: no indexer of upstream's reads its pool)."""
    got = reload_scenario(ROUTES["flashmla_kv-fp8-paged-indexshare"], "layer_first")
    got.gate.withhold = {1}
    with pytest.raises(LayerWithheld, match="layer 1 is withheld") as raised:
        got.worlds[0].forward(got.case)
    frames = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert any(f.endswith("sglang_cpkv/hooks/hicache.py") for f in frames), frames


CP = 2
CP2_ROUTE = "flashmla_kv-fp8-paged-indexshare"
CP2_LAYOUTS = {"layer_first": False, "page_first": True}  # host layout -> with an MTP draft


def _gloo_rank(rank, model_dir, init_method, out_dir):
    """One CP rank: upstream's distributed init and (patched) model-parallel groups, the mode's server args published;
    the scenario in both host layouts (the second with an MTP draft), and each request of batch 2 alone."""
    from sglang_cpkv.testing.dsa_kit import init_cp_rank, publish_prefill_cp_server_args

    torch.set_num_threads(1)
    init_cp_rank(rank, CP, "cpu", init_method, model_dir)
    publish_prefill_cp_server_args(model_dir, CP, mode_on=True)
    route = ROUTES[CP2_ROUTE]
    results = {}
    for layout, draft in CP2_LAYOUTS.items():
        got = reload_scenario(route, layout, draft=draft, cp_size=CP, cp_rank=rank)
        results[layout] = {
            "sharded": got.sharded,
            "pool pages": got.worlds[0].pool.kv_buffer[0].shape[0] // PAGE,
            "layers": [world.route.num_layers for world in got.worlds],
            "case": got.case,
            "runs": got.runs,
            "awaited": sorted(set(got.gate.awaited)),
            "pages": (got.before, got.after),
            "loaded": (got.saved, got.landed),
            "alone": alone_runs(route, got, cp_size=CP, cp_rank=rank),
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_kit_ranks(_gloo_rank, CP, tmp_path_factory.mktemp("hicache_cp2"))


@pytest.mark.parametrize("mem_layout", list(CP2_LAYOUTS))
def test_cp2_each_rank_loads_back_the_pages_it_owns_into_page_ids_it_owns(gloo_results, mem_layout):
    """Upstream's load allocates page ids of the host copy's owner class (alloc_cyclic): never another owner, so the
    rank that holds a page's bytes is the rank its new page id names; each rank's pool holds its own pages only."""
    route = ROUTES[CP2_ROUTE]
    for rank, results in enumerate(gloo_results):
        got = results[mem_layout]
        before, after = got["pages"]
        assert got["sharded"], "the controller moved every page on every rank: its KV host pool is not owner-sharded"
        assert not set(after) & set(before)
        assert [p % CP for p in after] == [p % CP for p in before], (before, after)
        assert got["pool pages"] * CP == got["case"].capacity
        _assert_loaded_as_before(got["layers"], *got["loaded"], f"rank {rank} {mem_layout}")
        assert got["awaited"] == list(range(route.num_layers))


@pytest.mark.parametrize("mem_layout", list(CP2_LAYOUTS))
def test_cp2_a_prefix_loaded_back_from_host_reads_as_it_did_before_it_left(gloo_results, mem_layout):
    got = [results[mem_layout] for results in gloo_results]
    _assert_read_alone(
        [g["runs"] for g in got], [g["alone"] for g in got], got[0]["layers"], got[0]["case"], f"cp 2 {mem_layout}"
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
