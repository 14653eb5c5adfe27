"""Upstream's DSA attention kit drives the patched backend with ``--enable-cp-shared-kv`` on, on CPU.

The objects are upstream's: the kit's ``DSAMockModelRunner`` and pools, the ``DeepseekSparseAttnBackend``
``ATTENTION_BACKENDS["dsa"]`` builds from it, the kit's sparse attention module (its ``RadixAttention``
calls ``forward_extend``), upstream's ``Indexer._store_index_k_cache``, upstream's CP split
(:mod:`sglang_cpkv.testing.dsa_kit`). The attention kernels need a GPU (``flash_mla``; ``triton_sparse_mla``
computes bf16 products the interpreter gets wrong): what each is handed is captured and reduced to the
bytes every query row reads.

For every route a server can take - bf16 and 656-byte FP8 pools; ``flashmla_sparse``, ``flashmla_kv``,
``triton_sparse_mla``; PAGED and RAGGED top-k; fused and unfused top-k; IndexShare layers - and every case
(the kit's own sparse-prefill cases, bs > 1 with shared prefix pages and radix hits, a request one CP rank
drops, a chunked continuation whose history the mode itself persisted owner-sharded), at cp 1 in this
process and cp 2 over gloo: the kernel reads the same KV rows with the mode on as with it off, the indexer
reads the same index K, and each request of a bs > 1 batch reads what it reads alone (bs = 1). At cp 2 with the
mode on each rank's pool holds only its owned pages (``capacity / 2`` pages, upstream's page-interleave allocator
as the runner's token allocator), the replicated mode-off run holds all of them; one batch's page tables are the
ones that allocator hands out (a shared prefix, rotation bases as upstream's allocation passes them), and its
ranks' pools after the forward are the replica's owned pages, byte for byte.

Regressions (each failed before its fix): a) IndexShare layers crashed the mode at layer 0; b) the RAGGED
route with a radix hit asserted on the pool capacity; c) the fused-indexer store bypassed the mode; d) the
MTP seed export of a no-prefix RAGGED CP cut mapped dense top-k through pool locations.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.batches import BatchCase, same_bytes
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import (
    PAGE,
    KitRoute,
    KitWorld,
    assert_reads_alone,
    distinct_page_tables,
    kit_capacity,
    request_reads,
    run_kit_ranks,
)
from sglang_cpkv.testing.host_reads import HOST_MEMORY_READS, HostReadCounter

register_cpu_ci(est_time=600, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

PAGED_BF16 = KitRoute("flashmla_sparse")
RAGGED_FP8 = KitRoute("flashmla_sparse", fp8=True)
ROUTES = {
    "flashmla_sparse-bf16-paged": PAGED_BF16,
    "flashmla_sparse-fp8-ragged": RAGGED_FP8,
    "flashmla_kv-fp8-paged": KitRoute("flashmla_kv", fp8=True),
    "triton_sparse_mla-bf16-paged": KitRoute("triton_sparse_mla"),
    "flashmla_sparse-bf16-unfused": KitRoute("flashmla_sparse", fused_topk=False),
}
INDEX_SHARE = (False, True, False)  # layer 1 reuses layer 0's top-k: no index-K pool


def _world(route, case_or_shape, mode_on, **kw):
    max_requests, longest = case_or_shape
    return KitWorld(route, max_requests=max_requests, longest=longest, mode_on=mode_on, device="cpu", **kw)


def _assert_same_reads(off, on, what):
    for layer, (a, b) in enumerate(zip(off.kernel, on.kernel)):
        assert a.kernel == b.kernel, (what, layer)
        assert same_bytes(a.q, b.q), f"{what} layer {layer}: query rows differ"
        assert torch.equal(a.valid, b.valid), f"{what} layer {layer}: top-k padding differs"
        assert same_bytes(a.rows, b.rows), f"{what} layer {layer}: the kernel reads other KV rows with the mode on"
        assert int(a.valid.sum()) > 0
    assert off.index_k.keys() == on.index_k.keys()
    for layer in off.index_k:
        for x, y in zip(off.index_k[layer], on.index_k[layer]):
            assert same_bytes(x, y), f"{what} layer {layer}: the indexer reads other index K with the mode on"


def _run_pair(route, case, shape, **kw):
    runs = []
    for mode_on in (False, True):
        world = _world(route, shape, mode_on, **kw)
        world.write_history(case)
        runs.append(world.forward(case))
    return runs


def _kit_sparse_prefill_cases():
    from sglang_cpkv.testing.dsa_kit import _upstream

    kit = _upstream()["kit"]
    return [c for c in kit.make_dsa_sparse_cases("dsa") if c.forward_mode.is_extend()]


# The kit's cases hold 2048-token histories, and on CPU upstream's cache writers run in the Triton
# interpreter (seconds per 2048 rows), so CI runs all three on one route and one on a second; every route
# runs them in the GPU suite (test_cp_shared_kv_kit_cuda.py).
@pytest.mark.parametrize(
    "route_name, which", [("flashmla_sparse-bf16-paged", slice(None)), ("triton_sparse_mla-bf16-paged", slice(2, 3))]
)
def test_kit_sparse_prefill_cases_read_the_same_kv_with_the_mode_on(route_name, which):
    route = ROUTES[route_name]
    cases = _kit_sparse_prefill_cases()
    assert [c.name for c in cases] == [
        "dsa_sparse_prefill_flashmla_sparse_topk",
        "dsa_sparse_prefill_long_extend",
        "dsa_sparse_prefill_multi_request",
    ]
    for i, kit_case in list(enumerate(cases))[which]:
        seq = [p + e for p, e in zip(kit_case.prefix_lens, kit_case.extend_lens)]
        shape = (len(seq), max(seq))
        capacity = kit_capacity(*shape)
        tables = distinct_page_tables(seq, capacity, seed=i)
        case = BatchCase(PAGE, capacity, tables, kit_case.prefix_lens, kit_case.extend_lens)
        off, on = _run_pair(route, case, shape)
        assert off.kernel[0].kernel == "_forward_" + route.prefill_backend
        _assert_same_reads(off, on, kit_case.name)


# Three requests: A and B share two full prefix pages (a radix hit), A's history ends mid-page and its chunk
# continues that page (CURRENT_REUSE), C has no history; page ids interleave across the pool.
SHARED_SHAPE = (3, 300)


def _shared_prefix_case(cp_size=1):
    capacity = kit_capacity(*SHARED_SHAPE, cp_size)
    return BatchCase(PAGE, capacity, ((4, 9, 2, 7), (4, 9, 5), (11, 3)), (170, 128, 0), (50, 40, 100), cp_size)


def _alone(case, r):
    return BatchCase(
        PAGE, case.capacity, (case.page_tables[r],), (case.prefix_lens[r],), (case.extend_lens[r],), case.cp_size
    )


def _rows_of_request(run, case, r, layer=0):
    start = sum(case.extend_lens[:r])
    mine = [i for i, t in enumerate(run.local_tokens.tolist()) if start <= t < start + case.extend_lens[r]]
    reads = run.kernel[layer]
    return reads.rows[mine], reads.valid[mine]


@pytest.mark.parametrize(
    "route_name",
    [
        "flashmla_sparse-bf16-paged",
        "flashmla_kv-fp8-paged",
        "flashmla_sparse-fp8-ragged",
        "flashmla_sparse-bf16-unfused",
    ],
)
def test_bs_gt_1_shared_prefix_reads_what_each_request_reads_alone(route_name):
    """C has no history beside A's and B's radix hit (on the RAGGED route, the case the queue's
    read-history-less-requests-alike-on-ragged.patch fixes)."""
    route = ROUTES[route_name]
    case = _shared_prefix_case()
    off, on = _run_pair(route, case, SHARED_SHAPE)
    _assert_same_reads(off, on, "bs 3")
    for r in range(case.num_requests):
        alone = _alone(case, r)
        world = _world(route, SHARED_SHAPE, True)
        world.write_history(alone)
        solo = world.forward(alone)
        rows, valid = _rows_of_request(on, case, r)
        assert torch.equal(valid, solo.kernel[0].valid)
        assert same_bytes(rows, solo.kernel[0].rows), f"request {r} reads other rows in the batch than alone"


def _sharing_case(cp_size=1):
    """The dense layout's sharing patterns in one batch (testing/batches.sharing_patterns): A and B share pages 4
    and 9 as history only (one shared history slot each); B reads page 2 as history while A's history ends in it
    and A's chunk continues it (a shared page that is A's CURRENT_REUSE page); C reads page 7 as history while A
    writes its current tokens into page 7 (allocator reuse). The last two are collision-class states: upstream's
    own pool path cannot serve them (it writes the chunk into the pool before attention), so each request is
    compared with itself alone."""
    capacity = kit_capacity(*SHARED_SHAPE, cp_size)
    return BatchCase(PAGE, capacity, ((4, 9, 2, 7), (4, 9, 2, 5), (7, 3)), (170, 192, 64), (50, 40, 30), cp_size)


@pytest.mark.parametrize("route_name", [*ROUTES, "flashmla_sparse-fp8-ragged-indexshare"])
def test_sharing_patterns_read_what_each_request_reads_alone(route_name):
    from sglang_cpkv.testing.batches import HISTORY_WRITTEN, SHARED_HISTORY, SHARED_REUSE, sharing_patterns

    route = ROUTES.get(route_name) or KitRoute("flashmla_sparse", fp8=True, skip_topk_layers=INDEX_SHARE)
    case = _sharing_case()
    assert sharing_patterns(case) == {SHARED_HISTORY, SHARED_REUSE, HISTORY_WRITTEN}
    world = _world(route, SHARED_SHAPE, True)
    world.write_history(case)
    batch = world.forward(case)
    plan = world.backend.cp_shared_kv.batch.plan
    # Pages 4 and 9 are one shared history slot each; pages 2 and 7 take A's current tokens, so every entry of them
    # is its request's own slot (B's and C's history rows copied in from the region), never shared.
    # At cp 1 the region holds the history-only pages (4, 9): the own slots of pages 2 and 7 take their history
    # rows straight from the pool.
    region = plan.history_region_slots
    assert region == 2 and plan.request_slots(0)[:2].tolist() == plan.request_slots(1)[:2].tolist()
    assert all(int(plan.request_slots(r)[-1]) >= region for r in range(3))
    assert int(plan.request_slots(1)[2]) >= region and int(plan.request_slots(2)[0]) >= region
    assert plan.needed_slots == region + 6  # region (4, 9) + A's 2, 7, B's 2, 5, C's 7, 3
    for layer in range(route.num_layers):
        alone = {}
        for r in range(case.num_requests):
            solo_case = _alone(case, r)
            solo = _world(route, SHARED_SHAPE, True)
            solo.write_history(solo_case)
            run = solo.forward(solo_case)
            alone.update({(r, p): v for (_, p), v in request_reads([(run, solo_case)], layer).items()})
        assert_reads_alone(request_reads([(batch, case)], layer), alone, f"{route_name} layer {layer}")
    for layer in batch.index_k:  # the indexer read each request's own history too (dense index-K pages)
        assert batch.index_k[layer]


def _target_and_draft(route, shape, mode_on, **kw):
    """The two DSA backends of an EAGLE/NextN prefill server: the target's, and its MTP draft's with a pool of its
    own (one layer at start layer 0, as upstream builds a NextN draft's pool) over the same page ids, other weights.
    Upstream's draft extend on a prefill server (``_draft_extend_for_prefill``) is an EXTEND batch of the target's
    requests, lengths and cache locations on the draft's backend, split like the target's under CP; the target's
    pool sizing charges the mode's buffers for both backends (``backends=2``)."""
    import dataclasses

    from sglang_cpkv.hooks.reservation import publish, published

    target = _world(route, shape, mode_on, **kw)
    draft = _world(dataclasses.replace(route, skip_topk_layers=(False,)), shape, mode_on, seed=1, **kw)
    if mode_on:
        publish(dataclasses.replace(published(), backends=2))
    return target, draft


def _draft_extend(target, draft, case):
    """The target's extend, then the draft's of the same batch: ``(target run, draft run)``."""
    for world in (target, draft):
        world.write_history(case)
    return target.forward(case), draft.forward(case)


@pytest.mark.parametrize("route_name", ["flashmla_sparse-bf16-paged", "flashmla_sparse-fp8-ragged"])
def test_an_mtp_draft_extends_through_the_mode_beside_its_target(route_name):
    """The draft's extend runs through the mode as a second backend of its own (its plan, views and owned writes,
    its own set of the reserved buffers): it reads what it reads with the mode off, its pool holds what the mode off
    writes, and each request of the batch reads what it reads alone; the target's batch is unchanged beside it. A
    P/D prefill server runs no verify (upstream's prefill loop builds prefill batches only), so what the extends
    wrote is what the decode server gets."""
    from sglang_cpkv.hooks import dsa_batch
    from sglang_cpkv.hooks.reservation import published

    route = ROUTES[route_name]
    case = _shared_prefix_case()
    runs = {mode_on: _draft_extend(*_target_and_draft(route, SHARED_SHAPE, mode_on), case) for mode_on in (False, True)}
    for world, what in ((0, "target"), (1, "draft")):
        _assert_same_reads(runs[False][world], runs[True][world], f"{route_name} {what}")
    assert same_bytes(runs[False][1].pool_after[0], runs[True][1].pool_after[0]), "the draft's pool differs"
    target, draft = _target_and_draft(route, SHARED_SHAPE, True)
    _draft_extend(target, draft, case)
    reserved = published()
    per_backend = (reserved.total_bytes - reserved.backends * reserved.parts()["batch plan"]) // reserved.backends
    states = [getattr(world.backend, dsa_batch.STATE_ATTR) for world in (target, draft)]
    assert states[0] is not states[1] and states[1].batch.plan.num_requests == case.num_requests
    assert [state.buffers.held_bytes("") for state in states] == [per_backend, per_backend]
    for r in range(case.num_requests):
        solo_target, solo_draft = _target_and_draft(route, SHARED_SHAPE, True)
        solo = _draft_extend(solo_target, solo_draft, _alone(case, r))[1]
        rows, valid = _rows_of_request(runs[True][1], case, r)
        assert torch.equal(valid, solo.kernel[0].valid)
        assert same_bytes(rows, solo.kernel[0].rows), f"draft request {r} reads other rows in the batch than alone"


@pytest.mark.parametrize("mode_on", [False, True], ids=["mode off", "mode on"])
def test_ragged_reads_a_history_less_request_alike_in_any_batch(mode_on):
    """Upstream's RAGGED route picks the keys for the whole batch: beside a request with a cached prefix, every
    request's keys came from the FP8 cache (quantized, then dequantized), while a request without history alone
    reads its chunk's bf16 rows (docs/upstream-findings.md item 3). With the queue's fix
    (read-history-less-requests-alike-on-ragged.patch) it reads its bf16 rows in any batch, mode off and on."""
    case = _shared_prefix_case()  # request 2 has no history, requests 0 and 1 have
    runs = []
    for batch in (case, _alone(case, 2)):
        world = _world(RAGGED_FP8, SHARED_SHAPE, mode_on)
        world.write_history(batch)
        runs.append(world.forward(batch))
    for layer in range(RAGGED_FP8.num_layers):
        rows, valid = _rows_of_request(runs[0], case, 2, layer)
        assert torch.equal(valid, runs[1].kernel[layer].valid)
        assert same_bytes(rows, runs[1].kernel[layer].rows), f"layer {layer}: request 2 reads other keys than alone"
        for r in (0, 1):  # the requests with history still read their cache rows, as alone
            alone = _world(RAGGED_FP8, SHARED_SHAPE, mode_on)
            alone.write_history(_alone(case, r))
            solo = alone.forward(_alone(case, r))
            rows, valid = _rows_of_request(runs[0], case, r, layer)
            assert same_bytes(rows, solo.kernel[layer].rows), f"layer {layer}: request {r} reads other keys than alone"


def test_a_batch_past_the_reservation_is_refused_naming_the_setting():
    """The admission hook keeps batches under --cp-shared-kv-max-batch-tokens; a batch that still exceeds the
    reservation is refused at plan build with the setting named, before any buffer is touched."""
    import dataclasses

    from sglang_cpkv.hooks.reservation import publish, published
    from sglang_cpkv.ops.errors import CpSharedKvError
    from sglang_cpkv.runtime.reservation import SETTING

    case = _shared_prefix_case()  # the history region (4, 9) and own pages (A's 2, 7; B's 5; C's 11, 3): 7 pages
    world = _world(PAGED_BF16, SHARED_SHAPE, True)
    world.write_history(case)
    publish(dataclasses.replace(published(), max_batch_tokens=6 * PAGE))
    with pytest.raises(CpSharedKvError, match=f"needs 448 tokens of dense KV .* more than {SETTING} 384"):
        world.forward(case)


@pytest.mark.parametrize("layer_ahead", ["0", "1"], ids=["synchronous", "layer-ahead"])
def test_index_share_layers(layer_ahead, monkeypatch):
    """Regression a: layers that reuse another layer's top-k have a 0-row index-K pool; the mode must neither
    prefetch nor materialize index K for them (it crashed at layer 0: 'pool has 0 rows'), with each layer's history
    taken by the layer itself or one layer ahead (the prefetch of the next layer that has an indexer). The RAGGED
    route with IndexShare layers runs at cp 2 below."""
    monkeypatch.setenv("SGLANG_CPKV_LAYER_AHEAD", layer_ahead)
    route = KitRoute("flashmla_sparse", skip_topk_layers=INDEX_SHARE)
    case = _shared_prefix_case()
    off, on = _run_pair(route, case, SHARED_SHAPE)
    assert len(on.kernel) == 3 and sorted(on.index_k) == [0, 2]
    _assert_same_reads(off, on, "IndexShare")


def test_ragged_radix_hit_beyond_pool_capacity():
    """Regression b: on the RAGGED route with a radix hit, a batch whose tokens exceed the pool (three requests
    on one shared prefix, a pool sized for one) asserted 'Invalid page table index: max=..., kv_cache_capacity=...':
    upstream's check compared the dense-view locations with the pool size."""
    shape = (1, 256)
    capacity = kit_capacity(*shape)  # 7 pages: 448 token rows
    case = BatchCase(PAGE, capacity, ((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 6)), (192, 192, 192), (30, 30, 30))
    assert sum(p + e for p, e in zip(case.prefix_lens, case.extend_lens)) > capacity * PAGE
    off, on = _run_pair(RAGGED_FP8, case, (3, 256), pool_requests=1)
    _assert_same_reads(off, on, "radix hit beyond the pool")


def test_fused_indexer_store_goes_through_the_mode(monkeypatch):
    """Regression c: the fused-indexer route (use_dsa_indexer_fusion, an un-split batch) stores index K with
    fused_k_indexer_norm_rope_store into _index_k_write_targets, bypassing the mode, so the layer's dense
    index-K read found no current keys. On CPU the CUDA kernel and its availability check are stood in for
    (quantize + upstream's SetKAndS into each target the patched method hands it)."""
    from types import SimpleNamespace

    from sglang_cpkv.testing.dsa_kit import _upstream

    _upstream()  # upstream's import closure on CPU (the torchvision stub) before its indexer module
    import sglang.srt.layers.attention.dsa.dsa_indexer as indexer_module
    from sglang.kernels.ops.kvcache import dsa_index_k_cache

    from sglang_cpkv.hooks import dsa_batch, dsa_index_k

    case = _shared_prefix_case()
    reads = []
    for mode_on in (False, True):
        world = _world(PAGED_BF16, SHARED_SHAPE, mode_on)
        world.write_history(case)
        world.forward(case)  # begins the batch; the indexer's own store is redone below through the fused route
        act_quant, pool, forward_batch = world.act_quant, world.pool, world.forward_batch

        def fused_store(key_raw, buf, loc, weight, bias, eps, cos_sin, positions, page_size, pool=pool, aq=act_quant):
            index_k, scale = aq(key_raw, 128, None)
            dsa_index_k_cache.SetKAndS.execute(pool=pool, buf=buf, loc=loc, index_k=index_k, index_k_scale=scale)

        monkeypatch.setattr(indexer_module, "can_use_dsa_fused_store", lambda *a: True)
        # Defined only where CUDA is (imported under _is_cuda): set it either way.
        monkeypatch.setattr(indexer_module, "fused_k_indexer_norm_rope_store", fused_store, raising=False)
        indexer = SimpleNamespace(
            k_norm=SimpleNamespace(weight=None, bias=None, variance_epsilon=1e-6), _indexer_cos_sin_cache=None
        )
        keys = world._keys(torch.tensor(case.out_cache_loc()), 0)
        positions = torch.zeros(case.num_tokens, dtype=torch.int64)
        with world.up["context"](world.backend):
            batch = dsa_batch.extend_batch(world.backend, forward_batch)
            if batch is not None:
                batch.index_k_stored_layer = None  # the read below needs this store's keys
            indexer_module.Indexer._fused_k_prepare_and_store(indexer, keys, positions, forward_batch, 0, act_quant)
            metadata = world.backend.get_indexer_metadata(0, forward_batch)
            seq_lens = metadata.get_indexer_seq_len_cpu()
            reads.append(
                dsa_index_k.index_k_and_scale(
                    pool,
                    forward_batch,
                    0,
                    metadata.get_indexer_seq_len(),
                    metadata.get_logical_page_table(),
                    int(seq_lens.sum()),
                    int(seq_lens.max()),
                )
            )
        monkeypatch.undo()
    for x, y in zip(*reads):
        assert same_bytes(x, y)


# --- cp = 2 over gloo ------------------------------------------------------------------------------------------

CP = 2


def _gloo_rank(rank, model_dir, init_method, out_dir):
    """One CP rank: upstream's distributed init and (patched) model-parallel groups, then every scenario with
    the mode off and on; writes what each forward read."""
    from sglang_cpkv.testing.dsa_kit import init_cp_rank, publish_prefill_cp_server_args

    torch.set_num_threads(1)
    from sglang.srt.distributed import parallel_state

    from sglang_cpkv.hooks import dsa_batch, exchange_group
    from sglang_cpkv.hooks.reservation import published

    results = {}
    init_cp_rank(rank, CP, "cpu", init_method, model_dir)
    attn_cp = parallel_state.get_attn_cp_group()
    group = exchange_group.exchange_group()
    results["group"] = (group.cp_size, group.cp_rank, group.group is not attn_cp.device_group)
    for name, route, cases, shape in _cp2_scenarios():
        for mode_on in (False, True):
            publish_prefill_cp_server_args(model_dir, CP, mode_on=mode_on)
            world = KitWorld(
                route, max_requests=shape[0], longest=shape[1], mode_on=mode_on, device="cpu", cp_size=CP, cp_rank=rank
            )
            results[("pool pages", name, mode_on)] = world.pool.kv_buffer[0].shape[0] // PAGE
            if mode_on and name == "allocator-shared-prefix-paged":
                # The world's own allocator (built by the mode's hook) hands out the same page tables.
                results[("allocator", name)] = (type(world.allocator).__name__, _allocator_case(world.allocator))
            runs = []
            for i, case in enumerate(cases):
                if i == 0:
                    world.write_history(case)
                with HostReadCounter() as reads:
                    runs.append(world.forward(case))
                results[("host reads", name, mode_on, i)] = dict(reads.counts)
                state = getattr(world.backend, dsa_batch.STATE_ATTR, None)
                results[("latent bytes", name, mode_on, i)] = 0 if state is None else state.buffers.held_bytes("latent")
                if mode_on:
                    reserved = published()
                    plan_part = reserved.backends * reserved.parts()["batch plan"]
                    results[("held bytes", name, i)] = (state.buffers.held_bytes(""), reserved.total_bytes - plan_part)
                    plan = state.batch.plan
                    staged = plan.entries * (4 + 4 + 8)
                    results[("plan bytes", name, i)] = (plan.device_bytes + staged, plan_part)
            seed = None
            if name == "ragged-no-prefix-cut":
                seed = _mtp_seed(world)
            results[(name, mode_on)] = (runs, seed)
            if mode_on and name in ALONE_CP2:
                for r in range(cases[0].num_requests):
                    solo_case = _alone(cases[0], r)
                    solo = KitWorld(
                        route,
                        max_requests=shape[0],
                        longest=shape[1],
                        mode_on=True,
                        device="cpu",
                        cp_size=CP,
                        cp_rank=rank,
                    )
                    solo.write_history(solo_case)
                    results[("alone", name, r)] = (solo.forward(solo_case), solo_case)
    # An MTP draft's extend beside its target's: two backends, one exchange group.
    for mode_on in (False, True):
        publish_prefill_cp_server_args(model_dir, CP, mode_on=mode_on)
        worlds = _target_and_draft(RAGGED_FP8, SHARED_SHAPE, mode_on, cp_size=CP, cp_rank=rank)
        results[("mtp-draft", mode_on)] = _draft_extend(*worlds, _shared_prefix_case(CP))
    sharing = _sharing_case(CP)
    for r, case in [(None, sharing), *((r, _alone(sharing, r)) for r in range(sharing.num_requests))]:
        worlds = _target_and_draft(RAGGED_FP8, SHARED_SHAPE, True, cp_size=CP, cp_rank=rank)
        results[("mtp-draft sharing", r)] = _draft_extend(*worlds, case)[1]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _mtp_seed(world):
    """The MTP IndexShare seed export of the last forward (a fused RAGGED top-k of every local row)."""
    backend = world.backend
    metadata = backend.forward_metadata
    rows = metadata.topk_indices_offset.shape[0]
    seq = metadata.dsa_cache_seqlens_int32.to(torch.int64)[:rows]
    positions = torch.arange(8).expand(rows, 8)
    topk = torch.where(positions < seq[:, None], positions + metadata.topk_indices_offset[:, None], -1).to(torch.int32)
    with world.up["context"](backend):
        return backend.prepare_mtp_seed_indices(topk, world.up["extend"]).clone()


def _allocator_case(allocator=None):
    """``(case, rotation bases)``: a bs 3 batch whose page tables upstream's ``PageInterleavePoolAllocator`` hands
    out at cp 2 (a fresh one sized as a mode-on KitWorld's, or ``allocator``), through ``alloc_extend`` with the
    rotation bases upstream's allocation passes: a cached two-page prefix prefilled first (a new chain: base None,
    resolved by the allocator), then requests A and B that hit it (the prefix chain's base, page-aligned prefix) and
    C, a new chain. Page ids stay global; each rank's pool holds its owned ones."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    capacity = kit_capacity(*SHARED_SHAPE, CP)
    if allocator is None:
        allocator = PageInterleavePoolAllocator(
            (capacity // CP - 1) * PAGE,
            physical_page_size=PAGE,
            shard_size=CP,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )

    def alloc(prefix_lens, seq_lens, last_loc, bases):
        p, q = torch.tensor(prefix_lens), torch.tensor(seq_lens)
        n = int((q - p).sum())
        return allocator.alloc_extend(p, p, q, q, torch.tensor(last_loc), n, rotation_bases=bases)

    prefix, extend = 2 * PAGE, (150, 90, 100)
    prefix_base = [None]
    prefix_locs = alloc([0], [prefix], [-1], prefix_base)
    shared = tuple((prefix_locs[::PAGE] // PAGE).tolist())
    bases = [prefix_base[0], prefix_base[0], None]
    prefix_lens = (prefix, prefix, 0)
    last = int(prefix_locs[-1])
    locs = alloc(list(prefix_lens), [p + e for p, e in zip(prefix_lens, extend)], [last, last, -1], bases).tolist()
    tables, start = [], 0
    for p, e in zip(prefix_lens, extend):
        new = tuple(dict.fromkeys(loc // PAGE for loc in locs[start : start + e]))  # extends start page-aligned
        tables.append((shared if p else ()) + new)
        start += e
    return BatchCase(PAGE, capacity, tuple(tables), prefix_lens, extend, CP), tuple(bases)


def _cp2_scenarios():
    shared2 = _shared_prefix_case(CP)
    # A request with one token: one rank holds none of it and drops it from its metadata (bs_idx).
    dropped = BatchCase(PAGE, shared2.capacity, ((4, 9, 2, 7), (6,), (4, 9, 5)), (170, 0, 128), (50, 1, 40), CP)
    # Chunked continuation: chunk 1 prefills 200 tokens of two requests; chunk 2 reads them as history (persisted
    # by chunk 1, owner-sharded under the mode) and continues mid-page.
    chunk1 = BatchCase(PAGE, shared2.capacity, ((4, 9, 2, 7), (11, 3, 8)), (0, 0), (200, 150), CP)
    chunk2 = BatchCase(PAGE, shared2.capacity, ((4, 9, 2, 7), (11, 3, 8)), (200, 150), (50, 30), CP)
    no_prefix = BatchCase(PAGE, shared2.capacity, ((4, 9), (6,), (11,)), (0, 0, 0), (100, 1, 40), CP)
    index_share = KitRoute("flashmla_sparse", skip_topk_layers=INDEX_SHARE)
    return [
        ("shared-ragged", RAGGED_FP8, [shared2], SHARED_SHAPE),
        ("dropped-paged", PAGED_BF16, [dropped], SHARED_SHAPE),
        (
            "dropped-ragged-indexshare",
            KitRoute("flashmla_sparse", fp8=True, skip_topk_layers=INDEX_SHARE),
            [dropped],
            SHARED_SHAPE,
        ),
        ("chunked-paged-indexshare", index_share, [chunk1, chunk2], SHARED_SHAPE),
        ("ragged-no-prefix-cut", RAGGED_FP8, [no_prefix], SHARED_SHAPE),
        # RAGGED chunk 1 has no prefix: no dense latent view, the owned rows go straight to the pool; chunk 2
        # reads them back as history through the view.
        ("chunked-ragged", RAGGED_FP8, [chunk1, chunk2], SHARED_SHAPE),
        # Page tables of upstream's page-interleave allocator (bs 3, a shared prefix of two requests).
        ("allocator-shared-prefix-paged", PAGED_BF16, [_allocator_case()[0]], SHARED_SHAPE),
        # The sharing patterns of the dense layout, collision class: compared with each request alone (below).
        *((name, route, [_sharing_case(CP)], SHARED_SHAPE) for name, route in SHARING_CP2_ROUTES.items()),
    ]


SHARING_CP2_ROUTES = {
    "sharing-paged": PAGED_BF16,
    "sharing-ragged-indexshare": KitRoute("flashmla_sparse", fp8=True, skip_topk_layers=INDEX_SHARE),
    "sharing-unfused": KitRoute("flashmla_sparse", fused_topk=False),
    "sharing-flashmla_kv-fp8": KitRoute("flashmla_kv", fp8=True),
    "sharing-triton_sparse_mla": KitRoute("triton_sparse_mla"),
}


# Each request of these batches is also run alone at cp 2 (mode on): shared-ragged's C has no history beside A's
# and B's radix hit (the RAGGED route's per-request keys).
ALONE_CP2 = (*SHARING_CP2_ROUTES, "shared-ragged")


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_kit_ranks(_gloo_rank, CP, tmp_path_factory.mktemp("kit_cp2"))


def test_cp2_exchange_group_made_by_the_patched_model_parallel_init(gloo_results):
    for rank, results in enumerate(gloo_results):
        assert results["group"] == (CP, rank, True)


@pytest.mark.parametrize("name", [s[0] for s in _cp2_scenarios() if s[0] not in SHARING_CP2_ROUTES])
def test_cp2_each_rank_reads_the_same_kv_with_the_mode_on(gloo_results, name):
    for rank, results in enumerate(gloo_results):
        off, on = results[(name, False)][0], results[(name, True)][0]
        for forward, (a, b) in enumerate(zip(off, on)):
            _assert_same_reads(a, b, f"{name} rank {rank} forward {forward}")


def _assert_cp2_reads_alone(gloo_results, name, case, num_layers):
    """Scenario ``name``'s batch at cp 2 (both ranks' query rows together) reads, at every position of every request
    and every layer, what that request reads alone at cp 2 (mode on)."""
    for layer in range(num_layers):
        batch = request_reads([(results[(name, True)][0][0], case) for results in gloo_results], layer)
        alone = {}
        for r in range(case.num_requests):
            runs = [results[("alone", name, r)] for results in gloo_results]
            alone.update({(r, p): v for (_, p), v in request_reads(runs, layer).items()})
        assert_reads_alone(batch, alone, f"{name} layer {layer}")


@pytest.mark.parametrize("name", list(SHARING_CP2_ROUTES))
def test_cp2_sharing_patterns_read_what_each_request_reads_alone(gloo_results, name):
    """The collision-class sharing batch at cp 2 (both ranks' query rows together) reads, at every position of every
    request, what that request reads alone at cp 2: shared history slots gathered in place, CURRENT_REUSE and reused
    pages in own slots."""
    _assert_cp2_reads_alone(gloo_results, name, _sharing_case(CP), SHARING_CP2_ROUTES[name].num_layers)


def test_cp2_an_mtp_draft_extends_through_the_mode_beside_its_target(gloo_results):
    """At cp 2 over gloo the draft's extend (RAGGED FP8) runs after its target's on each rank through the one exchange
    group: both read what they read with the mode off, each rank's draft pool holds the replica's owned pages, and
    on the sharing batch (collision class) each request's draft reads what it reads alone at cp 2."""
    capacity = _shared_prefix_case(CP).capacity
    for rank, results in enumerate(gloo_results):
        off, on = results[("mtp-draft", False)], results[("mtp-draft", True)]
        for world, what in ((0, "target"), (1, "draft")):
            _assert_same_reads(off[world], on[world], f"rank {rank} {what}")
        mine, replica = on[1].pool_after[0].reshape(capacity // CP, -1), off[1].pool_after[0].reshape(capacity, -1)
        assert same_bytes(mine, replica[torch.arange(capacity // CP) * CP + rank]), f"rank {rank}: the draft's pool"
    sharing = _sharing_case(CP)
    batch = request_reads([(results[("mtp-draft sharing", None)], sharing) for results in gloo_results])
    alone = {}
    for r in range(sharing.num_requests):
        runs = [(results[("mtp-draft sharing", r)], _alone(sharing, r)) for results in gloo_results]
        alone.update({(r, p): v for (_, p), v in request_reads(runs).items()})
    assert_reads_alone(batch, alone, "the draft at cp 2")


def test_cp2_ragged_requests_read_what_they_read_alone(gloo_results):
    """At cp 2 on the RAGGED route, the history-less C beside A's and B's radix hit reads, on both ranks, what it
    reads alone (its chunk's bf16 keys, the all-gathered chunk), and so do A and B (their cache rows); the mode off
    reads the same rows (test_cp2_each_rank_reads_the_same_kv_with_the_mode_on)."""
    name = "shared-ragged"
    case = next(cases[0] for n, _, cases, _ in _cp2_scenarios() if n == name)
    assert case.prefix_lens[2] == 0 and case.prefix_lens[0] > 0
    _assert_cp2_reads_alone(gloo_results, name, case, RAGGED_FP8.num_layers)


def test_cp2_allocator_page_tables_come_from_its_owner_classes(gloo_results):
    """The batch is what it claims: its page ids are the page-interleave allocator's, none reserved, each chain's
    pages cycling through the owner classes from its rotation base (A and B the prefix chain's), the prefix pages
    shared; every rank's mode-on world holds that allocator (built by the mode's hook) and it hands out the same."""
    case, bases = _allocator_case()
    tables = case.page_tables
    assert tables[0][:2] == tables[1][:2] and bases[0] == bases[1]
    pages = [p for table in tables for p in table]
    assert min(pages) >= CP and len(set(pages)) == len(pages) - 2 and max(pages) < case.capacity
    for table, base in zip(tables, bases):
        assert [p % CP for p in table] == [(base + j) % CP for j in range(len(table))], (table, base)
    assert {p % CP for p in pages} == set(range(CP))
    for rank, results in enumerate(gloo_results):
        name, (got_case, got_bases) = results[("allocator", "allocator-shared-prefix-paged")]
        assert name == "PageInterleavePoolAllocator"
        assert (got_case.page_tables, got_bases) == (tables, bases), rank


def test_cp2_each_rank_pool_holds_the_replicas_owned_pages(gloo_results):
    """With the mode on each rank's pool is ``capacity / cp`` pages, and after the forward its pool page ``q`` holds
    the bytes the replicated mode-off pool holds at page id ``q * cp + rank`` (history and current rows; pool page 0,
    the reserved one, left as the replica's reserved page ``rank``: unwritten)."""
    name = "allocator-shared-prefix-paged"
    case = _scenario_case(name, 0)
    for rank, results in enumerate(gloo_results):
        assert results[("pool pages", name, True)] == case.capacity // CP
        assert results[("pool pages", name, False)] == case.capacity
        off, on = results[(name, False)][0][0], results[(name, True)][0][0]
        for layer, (replica, mine) in enumerate(zip(off.pool_after, on.pool_after)):
            replica = replica.reshape(case.capacity, -1)
            mine = mine.reshape(case.capacity // CP, -1)
            owned = torch.arange(case.capacity // CP) * CP + rank
            assert same_bytes(mine, replica[owned]), f"rank {rank} layer {layer}: the pool is not the replica's pages"
            assert bool(replica[owned[1:]].any()) and not bool(mine[0].any())


def test_cp2_the_dropped_request_is_on_one_rank_only(gloo_results):
    """The scenario is what it claims: request 1's one token is on one rank, the other drops request 1."""
    case = next(cases for name, _, cases, _ in _cp2_scenarios() if name == "dropped-paged")[0]
    ends = torch.tensor(case.extend_lens).cumsum(0)
    holders = []
    for rank, results in enumerate(gloo_results):
        run = results[("dropped-paged", True)][0][0]
        if 1 in {int((ends <= t).sum()) for t in run.local_tokens.tolist()}:
            holders.append(rank)
    assert len(holders) == 1


def test_cp2_no_dense_latent_view_where_the_route_never_reads_it(gloo_results):
    """The RAGGED route on a batch without a cached prefix attends over the current rows themselves: the mode
    allocates no dense latent view for it (the index-K view is still read), and does for every batch that reads
    one. That chunk 1's owned rows still reach the pool is shown by chunk 2 reading them as history (above)."""
    for results in gloo_results:
        latent = {key[1:]: n for key, n in results.items() if key[0] == "latent bytes"}
        assert latent[("ragged-no-prefix-cut", True, 0)] == 0
        assert latent[("chunked-ragged", True, 0)] == 0 < latent[("chunked-ragged", True, 1)]
        assert latent[("shared-ragged", True, 0)] > 0 and latent[("chunked-paged-indexshare", True, 0)] > 0
        assert all(n == 0 for (_, mode_on, _), n in latent.items() if not mode_on)


def test_cp2_the_buffers_are_the_reservation_reused_across_batches(gloo_results):
    """Every buffer the mode holds was reserved: after a batch that reads a dense latent view the backend holds
    exactly the published reservation's buffers (dense views, scratch), and a second batch adds nothing; the batch's
    plan (its device tensors, the inverse's table included, and the staged entries) fits the batch-plan part."""
    for results in gloo_results:
        for key, (nbytes, charged) in ((k, v) for k, v in results.items() if k[0] == "plan bytes"):
            assert 0 < nbytes <= charged, (key, nbytes, charged)
        held = {key[1:]: value for key, value in results.items() if key[0] == "held bytes"}
        for (name, i), (nbytes, reserved) in held.items():
            if name == "ragged-no-prefix-cut" or (name == "chunked-ragged" and i == 0):
                assert 0 < nbytes < reserved, (name, i)  # no latent view or scratch there
            else:
                assert nbytes == reserved, (name, i, nbytes, reserved)


def test_cp2_one_host_read_per_batch_none_per_layer(gloo_results):
    for results in gloo_results:
        for key, counts in results.items():
            if key[0] != "host reads" or not key[2]:
                continue
            # only the plan's one copy of the history page ids reads data a GPU would hold; none in any layer
            ours = {where: n for where, n in counts.items() if where not in HOST_MEMORY_READS}
            history = any(p > 0 for p in _scenario_case(key[1], key[3]).prefix_lens)
            assert ours == ({"runtime.plan:build_plan": 1} if history else {}), (key, counts)


def _scenario_case(name, index):
    return next(cases for n, _, cases, _ in _cp2_scenarios() if n == name)[index]


def test_cp2_mtp_seed_export_maps_to_pool_locations(gloo_results):
    """Regression d: the seed of a no-prefix RAGGED CP-cut batch holds the same pool locations with the mode
    on as off (it mapped dense top-k through out_cache_loc, pool locations, and counted them as bad)."""
    for results in gloo_results:
        off, on = results[("ragged-no-prefix-cut", False)][1], results[("ragged-no-prefix-cut", True)][1]
        assert torch.equal(off, on) and bool((on >= 0).any())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
