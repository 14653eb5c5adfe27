"""Upstream's DSA attention kit drives the patched backend with the mode on, on a GPU (cp 1), with the real kernels.

The CUDA side of ``test_cp_shared_kv_kit.py``: upstream's real bf16 and 656-byte FP8 pools and cache writers on the
GPU, its fused index-K stores (``fused_store_index_k_cache``; ``fused_k_indexer_norm_rope_store`` of the
fused-indexer route) through the mode's write targets, and every route a Hopper server can take under the mode with
its real kernel: ``flashmla_sparse`` (bf16 PAGED, FP8 RAGGED, unfused top-k), ``flashmla_kv`` (FP8 PAGED),
``flashmla_auto`` (bf16 and FP8: upstream picks ``flashmla_sparse`` / ``flashmla_kv`` on Hopper) from the
``flash_mla`` library at 64 heads (GLM-5.1's heads per rank at cp 8, FlashMLA's Hopper head block), and
``triton_sparse_mla`` at 32 (the most it takes). Each kernel must read the same KV bytes and give the same output with
the mode on as off; each request of a bs > 1 batch (shared prefixes, the dense layout's sharing patterns,
IndexShare layers with the layer-ahead history on and off) must read and get what it does alone.

``flashmla_kv`` is FlashMLA's split-KV decode kernel: its tile schedule splits each query row's KV by the work of
the whole batch, so upstream itself rounds a row's output differently in another batch. There the comparison with the
row alone is of the bytes read, and of the output with the mode on against upstream's own output for the same batch
and for the request alone (both equal byte for byte). Also counts the host synchronizations the mode adds (CUDA
sync-debug mode): none per layer, one per batch.

Needs a CUDA device, upstream sglang and the ``flash_mla`` library (``scripts/gpu_env/install.sh``; with
``SGLANG_CPKV_REQUIRE_UPSTREAM=1`` a missing one fails instead of skipping).
"""

import inspect
import sys
import warnings
from pathlib import Path

import pytest
import torch

from sglang_cpkv.testing.batches import BatchCase, same_bytes
from sglang_cpkv.testing.ci_register import register_cuda_ci
from sglang_cpkv.testing.upstream_env import skip_or_fail

register_cuda_ci(est_time=300, stage="cpkv", runner_config="1-gpu")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
try:
    from sglang_cpkv.testing.dsa_kit import (
        PAGE,
        KitRoute,
        KitWorld,
        distinct_page_tables,
        kit_capacity,
        missing_kernel_library,
    )

    KitWorld  # noqa: B018 - imported for the tests below; the import itself needs upstream
    import sglang.test.kits.attention_unittest.attention_methods.dsa_attention  # noqa: F401
except ImportError as exc:
    skip_or_fail(f"needs the pinned upstream sglang: {exc}")

INDEX_SHARE = (False, True, False)  # layer 1 reuses layer 0's top-k: no index-K pool
ROUTES = {
    "flashmla_sparse-bf16-paged": KitRoute("flashmla_sparse"),
    "flashmla_sparse-fp8-ragged": KitRoute("flashmla_sparse", fp8=True),
    "flashmla_kv-fp8-paged": KitRoute("flashmla_kv", fp8=True),
    "flashmla_auto-bf16": KitRoute("flashmla_auto"),
    "flashmla_auto-fp8": KitRoute("flashmla_auto", fp8=True),
    "flashmla_sparse-bf16-unfused": KitRoute("flashmla_sparse", fused_topk=False),
    "triton_sparse_mla-bf16-paged": KitRoute("triton_sparse_mla"),
    "triton_sparse_mla-fp8-ragged": KitRoute("triton_sparse_mla", fp8=True),
}
INDEX_SHARE_ROUTES = {
    "flashmla_sparse-bf16-paged-indexshare": KitRoute("flashmla_sparse", skip_topk_layers=INDEX_SHARE),
    "flashmla_sparse-fp8-ragged-indexshare": KitRoute("flashmla_sparse", fp8=True, skip_topk_layers=INDEX_SHARE),
    "flashmla_kv-fp8-paged-indexshare": KitRoute("flashmla_kv", fp8=True, skip_topk_layers=INDEX_SHARE),
    "triton_sparse_mla-fp8-ragged-indexshare": KitRoute("triton_sparse_mla", fp8=True, skip_topk_layers=INDEX_SHARE),
}
SHARED_SHAPE = (3, 300)


def _heads(route):
    return 32 if route.prefill_backend == "triton_sparse_mla" else 64


def _split_kv(world):
    """Whether the batch ran FlashMLA's split-KV decode kernel (flashmla_kv, or flashmla_auto resolved to it)."""
    return world.backend.dsa_prefill_impl == "flashmla_kv"


def _world(route, shape, mode_on, **kw):
    missing = missing_kernel_library(route)
    if missing:
        skip_or_fail(f"{route.prefill_backend} needs the {missing} library (sgl-flash-mla), not installed here")
    return KitWorld(
        route,
        max_requests=shape[0],
        longest=shape[1],
        mode_on=mode_on,
        device="cuda",
        run_kernels=True,
        heads=_heads(route),
        **kw,
    )


def _run(route, case, shape, mode_on, **kw):
    world = _world(route, shape, mode_on, **kw)
    world.write_history(case)
    return world.forward(case), world


def _pair(route, case, shape, **kw):
    return [_run(route, case, shape, mode_on, **kw)[0] for mode_on in (False, True)]


def _assert_same(off, on, what):
    for layer, (a, b) in enumerate(zip(off.kernel, on.kernel)):
        assert same_bytes(a.q, b.q) and torch.equal(a.valid, b.valid), (what, layer)
        assert same_bytes(a.rows, b.rows), f"{what} layer {layer}: the kernel reads other KV rows with the mode on"
        assert a.output is not None and b.output is not None, f"{what} layer {layer}: the real kernel did not run"
        assert torch.equal(a.output, b.output), f"{what} layer {layer}: {a.kernel} output differs with the mode on"
    assert off.index_k.keys() == on.index_k.keys()
    for layer in off.index_k:
        for x, y in zip(off.index_k[layer], on.index_k[layer]):
            assert same_bytes(x, y), f"{what} layer {layer}: index K differs"


def _alone(case, r):
    return BatchCase(PAGE, case.capacity, (case.page_tables[r],), (case.prefix_lens[r],), (case.extend_lens[r],))


def _assert_each_request_as_alone(route, case, batch, batch_world, what):
    """Every request's rows of the mode-on ``batch`` read the KV bytes it reads alone (mode on) and get its output
    alone; on FlashMLA's split-KV kernel, whose rounding follows the batch, the output alone is instead upstream's own
    output alone (mode off), byte for byte (module docstring)."""
    split_kv = _split_kv(batch_world)
    for r in range(case.num_requests):
        solo, _ = _run(route, _alone(case, r), SHARED_SHAPE, True)
        solo_off = _run(route, _alone(case, r), SHARED_SHAPE, False)[0] if split_kv else None
        start = sum(case.extend_lens[:r])
        rows = slice(start, start + case.extend_lens[r])
        for layer, (mine, own) in enumerate(zip(batch.kernel, solo.kernel)):
            where = f"{what} request {r} layer {layer}"
            assert torch.equal(mine.valid[rows], own.valid), where
            assert same_bytes(mine.rows[rows], own.rows), f"{where}: other rows than alone"
            if split_kv:
                assert torch.equal(own.output, solo_off.kernel[layer].output), f"{where}: alone, other output than off"
            else:
                assert torch.equal(mine.output[rows], own.output), f"{where}: other output than alone"


@pytest.mark.parametrize("route_name", list(ROUTES))
def test_kit_sparse_prefill_cases(route_name):
    from sglang_cpkv.testing.dsa_kit import _upstream

    cases = [c for c in _upstream()["kit"].make_dsa_sparse_cases("dsa") if c.forward_mode.is_extend()]
    for i, kit_case in enumerate(cases):
        seq = [p + e for p, e in zip(kit_case.prefix_lens, kit_case.extend_lens)]
        shape = (len(seq), max(seq))
        capacity = kit_capacity(*shape)
        case = BatchCase(
            PAGE, capacity, distinct_page_tables(seq, capacity, i), kit_case.prefix_lens, kit_case.extend_lens
        )
        off, on = _pair(ROUTES[route_name], case, shape)
        _assert_same(off, on, kit_case.name)


def _shared_case():
    return BatchCase(
        PAGE, kit_capacity(*SHARED_SHAPE), ((4, 9, 2, 7), (4, 9, 5), (11, 3)), (170, 128, 0), (50, 40, 100)
    )


@pytest.mark.parametrize("route_name", list(ROUTES))
def test_bs_gt_1_each_request_equals_its_bs_1_run(route_name):
    route = ROUTES[route_name]
    case = _shared_case()
    off, _ = _run(route, case, SHARED_SHAPE, False)
    on, world = _run(route, case, SHARED_SHAPE, True)
    _assert_same(off, on, "bs 3")
    _assert_each_request_as_alone(route, case, on, world, "bs 3")


def _sharing_case():
    """The dense layout's sharing patterns (the CPU kit test's batch): pages 4 and 9 shared history slots, page 2 a
    shared page A continues, page 7 C's history that A writes. Collision-class states upstream's own pool path cannot
    serve (it writes A's chunk before attention), so each request is compared with itself alone."""
    return BatchCase(
        PAGE, kit_capacity(*SHARED_SHAPE), ((4, 9, 2, 7), (4, 9, 2, 5), (7, 3)), (170, 192, 64), (50, 40, 30)
    )


@pytest.mark.parametrize("route_name", [*ROUTES, *INDEX_SHARE_ROUTES])
def test_sharing_patterns_equal_each_request_alone_with_the_real_kernel(route_name):
    """Every request of the sharing batch reads what it reads alone and the real kernel computes, from its view, the
    output it computes alone (on the split-KV kernel: the bytes read are alone's, and alone the output is upstream's;
    upstream cannot serve this batch, so there is no mode-off batch to compare)."""
    from sglang_cpkv.testing.batches import HISTORY_WRITTEN, SHARED_HISTORY, SHARED_REUSE, sharing_patterns

    route = ROUTES.get(route_name) or INDEX_SHARE_ROUTES[route_name]
    case = _sharing_case()
    assert sharing_patterns(case) == {SHARED_HISTORY, SHARED_REUSE, HISTORY_WRITTEN}
    batch, world = _run(route, case, SHARED_SHAPE, True)
    _assert_each_request_as_alone(route, case, batch, world, route_name)


@pytest.mark.parametrize("layer_ahead", ["0", "1"], ids=["synchronous", "layer-ahead"])
@pytest.mark.parametrize("route_name", list(INDEX_SHARE_ROUTES))
def test_index_share_with_the_history_layer_ahead_and_synchronous(route_name, layer_ahead, monkeypatch):
    """IndexShare layers (layer 1 has no index-K pool and reuses layer 0's top-k) with each layer's history
    materialized by its own layer or one layer ahead on the side stream: the reads and outputs equal mode off, and the
    dense index-K view is filled for the layers that have an indexer only."""
    monkeypatch.setenv("SGLANG_CPKV_LAYER_AHEAD", layer_ahead)
    route = INDEX_SHARE_ROUTES[route_name]
    case = _shared_case()
    off, on = _pair(route, case, SHARED_SHAPE)
    assert sorted(on.index_k) == [0, 2]
    _assert_same(off, on, f"IndexShare, layer-ahead {layer_ahead}")


def test_index_share_and_ragged_radix_hit_beyond_the_pool():
    route = INDEX_SHARE_ROUTES["flashmla_sparse-fp8-ragged-indexshare"]
    capacity = kit_capacity(1, 256)
    case = BatchCase(PAGE, capacity, ((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 6)), (192, 192, 192), (30, 30, 30))
    off, on = _pair(route, case, (3, 256), pool_requests=1)
    assert sorted(on.index_k) == [0, 2]
    _assert_same(off, on, "IndexShare RAGGED radix hit")


@pytest.mark.parametrize("route_name", ["triton_sparse_mla-fp8-ragged", "flashmla_sparse-fp8-ragged"])
def test_ragged_no_prefix_chunk_and_its_continuation(route_name):
    """RAGGED chunk 1 has no cached prefix: the mode makes no dense latent view and writes the owned rows
    straight to the pool with upstream's FP8 writer; chunk 2 reads them back as history through the view."""
    from sglang_cpkv.hooks import dsa_batch

    capacity = kit_capacity(*SHARED_SHAPE)
    tables = ((4, 9, 2, 7), (11, 3, 8))
    chunks = [
        BatchCase(PAGE, capacity, tables, (0, 0), (200, 150)),
        BatchCase(PAGE, capacity, tables, (200, 150), (50, 30)),
    ]
    runs, latent_bytes = [], []
    for mode_on in (False, True):
        world = _world(ROUTES[route_name], SHARED_SHAPE, mode_on)
        world.write_history(chunks[0])
        forwards = []
        for chunk in chunks:
            forwards.append(world.forward(chunk))
            state = getattr(world.backend, dsa_batch.STATE_ATTR, None)
            latent_bytes.append(0 if state is None else state.buffers.held_bytes(dsa_batch.LATENT))
        runs.append(forwards)
    assert latent_bytes[2] == 0 < latent_bytes[3], latent_bytes
    for i, (off, on) in enumerate(zip(*runs)):
        _assert_same(off, on, f"chunk {i + 1}")


@pytest.mark.parametrize("route_name", ["triton_sparse_mla-bf16-paged", "flashmla_kv-fp8-paged"])
def test_the_mode_adds_one_host_sync_per_batch(route_name):
    """CUDA sync-debug mode counts every synchronizing call of a forward (plan build included): the mode on adds
    exactly one to what upstream's own code does with it off, the plan's one host copy of the batch's page ids (the
    dense layout's shared history slots are a function of them; under CP the exchange's blocks too), and none per
    layer."""
    route = ROUTES[route_name]
    case = _shared_case()
    counts = {}
    for mode_on in (False, True):
        world = _world(route, SHARED_SHAPE, mode_on)
        world.write_history(case)
        world.forward(case)  # warm every kernel and cache outside the count
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                world.forward(case)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        ours = [w for w in syncs if "sglang_cpkv" in w.filename and "testing" not in w.filename]
        counts[mode_on] = (len(syncs), [f"{w.filename}:{w.lineno}" for w in ours])
    from sglang_cpkv.runtime import plan as plan_module

    source = inspect.getsourcefile(plan_module)
    lines = Path(source).read_text().splitlines()
    copies = [i + 1 for i, line in enumerate(lines) if "table.cpu()" in line]  # the plan's one host copy
    assert len(copies) == 1, f"{source} should copy the page table to the host at one line, not at {copies}"
    assert counts[True][1] == [f"{source}:{copies[0]}"], f"host syncs in sglang_cpkv: {counts[True][1]}"
    print(f"{route_name}: synchronizing calls per forward: mode off {counts[False][0]}, mode on {counts[True][0]}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
