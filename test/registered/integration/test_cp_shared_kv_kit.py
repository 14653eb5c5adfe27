"""Upstream's DSA attention kit drives the patched backend with ``--enable-cp-shared-kv`` on, on CPU, at cp 1.

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

The kit's tests are four files, each a few minutes on the 2-core CI machine, their batches and routes in
:mod:`sglang_cpkv.testing.kit_cases`: this one (the routes and the regressions at cp 1);
``test_cp_shared_kv_kit_sharing.py`` (the dense layout's sharing patterns and an MTP draft at cp 1);
``test_cp_shared_kv_kit_cp2.py`` (every scenario at cp 2 over gloo, mode off and on);
``test_cp_shared_kv_kit_cp2_alone.py`` (each request of a cp 2 batch against its run alone; the MTP draft at cp 2).

Regressions (each failed before its fix): a) IndexShare layers crashed the mode at layer 0; b) the RAGGED
route with a radix hit asserted on the pool capacity; c) the fused-indexer store bypassed the mode; d) the
MTP seed export of a no-prefix RAGGED CP cut mapped dense top-k through pool locations (in
``test_cp_shared_kv_kit_cp2.py``).
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.batches import BatchCase, same_bytes
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, distinct_page_tables, kit_capacity
from sglang_cpkv.testing.kit_cases import (
    INDEX_SHARE,
    PAGED_BF16,
    RAGGED_FP8,
    ROUTES,
    SHARED_SHAPE,
    assert_same_reads,
    kit_world,
    rows_of_request,
    run_alone,
    run_case,
    run_pair,
    shared_prefix_case,
)

register_cpu_ci(est_time=105, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)


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
        off, on = run_pair(route, case, shape)
        assert off.kernel[0].kernel == "_forward_" + route.prefill_backend
        assert_same_reads(off, on, kit_case.name)


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
    case = shared_prefix_case()
    off, on = run_pair(route, case, SHARED_SHAPE)
    assert_same_reads(off, on, "bs 3")
    for r in range(case.num_requests):
        solo = run_alone(route, case, r)
        rows, valid = rows_of_request(on, case, r)
        assert torch.equal(valid, solo.kernel[0].valid)
        assert same_bytes(rows, solo.kernel[0].rows), f"request {r} reads other rows in the batch than alone"


@pytest.mark.parametrize("mode_on", [False, True], ids=["mode off", "mode on"])
def test_ragged_reads_a_history_less_request_alike_in_any_batch(mode_on):
    """Upstream's RAGGED route picks the keys for the whole batch: beside a request with a cached prefix, every
    request's keys came from the FP8 cache (quantized, then dequantized), while a request without history alone
    reads its chunk's bf16 rows (docs/upstream-findings.md item 3). With the queue's fix
    (read-history-less-requests-alike-on-ragged.patch) it reads its bf16 rows in any batch, mode off and on."""
    case = shared_prefix_case()  # request 2 has no history, requests 0 and 1 have
    batch = run_case(RAGGED_FP8, case, SHARED_SHAPE, mode_on)
    solo = [run_alone(RAGGED_FP8, case, r, mode_on=mode_on) for r in range(case.num_requests)]
    for layer in range(RAGGED_FP8.num_layers):
        rows, valid = rows_of_request(batch, case, 2, layer)
        assert torch.equal(valid, solo[2].kernel[layer].valid)
        assert same_bytes(rows, solo[2].kernel[layer].rows), f"layer {layer}: request 2 reads other keys than alone"
        for r in (0, 1):  # the requests with history still read their cache rows, as alone
            rows, valid = rows_of_request(batch, case, r, layer)
            assert same_bytes(rows, solo[r].kernel[layer].rows), (
                f"layer {layer}: request {r} reads other keys than alone"
            )


def test_a_batch_past_the_reservation_is_refused_naming_the_setting():
    """The admission hook keeps batches under --cp-shared-kv-max-batch-tokens; a batch that still exceeds the
    reservation is refused at plan build with the setting named, before any buffer is touched."""
    import dataclasses

    from sglang_cpkv.hooks.reservation import publish, published
    from sglang_cpkv.ops.errors import CpSharedKvError
    from sglang_cpkv.runtime.reservation import SETTING

    case = shared_prefix_case()  # the history region (4, 9) and own pages (A's 2, 7; B's 5; C's 11, 3): 7 pages
    world = kit_world(PAGED_BF16, SHARED_SHAPE, True)
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
    case = shared_prefix_case()
    off, on = run_pair(route, case, SHARED_SHAPE)
    assert len(on.kernel) == 3 and sorted(on.index_k) == [0, 2]
    assert_same_reads(off, on, "IndexShare")


def test_ragged_radix_hit_beyond_pool_capacity():
    """Regression b: on the RAGGED route with a radix hit, a batch whose tokens exceed the pool (three requests
    on one shared prefix, a pool sized for one) asserted 'Invalid page table index: max=..., kv_cache_capacity=...':
    upstream's check compared the dense-view locations with the pool size."""
    shape = (1, 256)
    capacity = kit_capacity(*shape)  # 7 pages: 448 token rows
    case = BatchCase(PAGE, capacity, ((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 6)), (192, 192, 192), (30, 30, 30))
    assert sum(p + e for p, e in zip(case.prefix_lens, case.extend_lens)) > capacity * PAGE
    off, on = run_pair(RAGGED_FP8, case, (3, 256), pool_requests=1)
    assert_same_reads(off, on, "radix hit beyond the pool")


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

    case = shared_prefix_case()
    reads = []
    for mode_on in (False, True):
        world = kit_world(PAGED_BF16, SHARED_SHAPE, mode_on)
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
