"""Upstream's DSA attention kit drives the patched backend with the mode on, on a GPU (cp 1).

The CUDA side of ``test_cp_shared_kv_kit.py``: upstream's real bf16 and 656-byte FP8 pools and cache writers
on the GPU, its fused index-K stores (``fused_store_index_k_cache``; ``fused_k_indexer_norm_rope_store`` of the
fused-indexer route) through the mode's write targets, and the real ``triton_sparse_mla`` kernel, whose output
must be equal with the mode on and off and, per request, equal its bs = 1 run. ``flashmla_sparse`` /
``flashmla_kv`` (the ``flash_mla`` library) are captured where they are absent. Also counts the host
synchronizations the mode adds (CUDA sync-debug mode): none per layer, none per batch at cp 1.

Needs a CUDA device and upstream sglang (``scripts/gpu_env/install.sh``; with ``SGLANG_CPKV_REQUIRE_UPSTREAM=1``
a missing upstream fails instead of skipping).
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

register_cuda_ci(est_time=240, stage="cpkv", runner_config="1-gpu")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
try:
    from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, distinct_page_tables, kit_capacity

    KitWorld  # noqa: B018 - imported for the tests below; the import itself needs upstream
    import sglang.test.kits.attention_unittest.attention_methods.dsa_attention  # noqa: F401
except ImportError as exc:
    skip_or_fail(f"needs the pinned upstream sglang: {exc}")

ROUTES = {
    "flashmla_sparse-bf16-paged": KitRoute("flashmla_sparse"),
    "flashmla_sparse-fp8-ragged": KitRoute("flashmla_sparse", fp8=True),
    "flashmla_kv-fp8-paged": KitRoute("flashmla_kv", fp8=True),
    "triton_sparse_mla-bf16-paged": KitRoute("triton_sparse_mla"),
    "triton_sparse_mla-fp8-ragged": KitRoute("triton_sparse_mla", fp8=True),
    "flashmla_sparse-bf16-unfused": KitRoute("flashmla_sparse", fused_topk=False),
}
TRITON = ["triton_sparse_mla-bf16-paged", "triton_sparse_mla-fp8-ragged"]
SHARED_SHAPE = (3, 300)


def _world(route, shape, mode_on, **kw):
    return KitWorld(
        route, max_requests=shape[0], longest=shape[1], mode_on=mode_on, device="cuda", run_triton=True, **kw
    )


def _pair(route, case, shape, **kw):
    runs = []
    for mode_on in (False, True):
        world = _world(route, shape, mode_on, **kw)
        world.write_history(case)
        runs.append(world.forward(case))
    return runs


def _assert_same(off, on, what):
    for layer, (a, b) in enumerate(zip(off.kernel, on.kernel)):
        assert same_bytes(a.q, b.q) and torch.equal(a.valid, b.valid), (what, layer)
        assert same_bytes(a.rows, b.rows), f"{what} layer {layer}: the kernel reads other KV rows with the mode on"
        if a.output is not None:
            assert torch.equal(a.output, b.output), f"{what} layer {layer}: triton_sparse_mla output differs"
    for layer in off.index_k:
        for x, y in zip(off.index_k[layer], on.index_k[layer]):
            assert same_bytes(x, y), f"{what} layer {layer}: index K differs"


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
        if route_name in TRITON:
            assert off.kernel[0].output is not None, "triton_sparse_mla must run for real here"
        _assert_same(off, on, kit_case.name)


def _shared_case():
    return BatchCase(
        PAGE, kit_capacity(*SHARED_SHAPE), ((4, 9, 2, 7), (4, 9, 5), (11, 3)), (170, 128, 0), (50, 40, 100)
    )


@pytest.mark.parametrize("route_name", TRITON + ["flashmla_kv-fp8-paged"])
def test_bs_gt_1_each_request_equals_its_bs_1_run(route_name):
    route = ROUTES[route_name]
    case = _shared_case()
    if route.fp8 and route.prefill_backend != "flashmla_kv":
        # RAGGED: upstream reads a request without history from its bf16 rows alone but from the dequantized FP8
        # cache in a batch where another request has history; every request gets one, so bs = 1 compares.
        case = BatchCase(PAGE, case.capacity, case.page_tables, (170, 128, 64), (50, 40, 36))
    off, on = _pair(route, case, SHARED_SHAPE)
    _assert_same(off, on, "bs 3")
    for r in range(case.num_requests):
        alone = BatchCase(PAGE, case.capacity, (case.page_tables[r],), (case.prefix_lens[r],), (case.extend_lens[r],))
        world = _world(route, SHARED_SHAPE, True)
        world.write_history(alone)
        solo = world.forward(alone)
        start = sum(case.extend_lens[:r])
        rows = slice(start, start + case.extend_lens[r])
        assert same_bytes(on.kernel[0].rows[rows], solo.kernel[0].rows), f"request {r}: other rows than alone"
        if solo.kernel[0].output is not None:
            assert torch.equal(on.kernel[0].output[rows], solo.kernel[0].output), f"request {r}: other output"


@pytest.mark.parametrize("route_name", TRITON)
def test_sharing_patterns_equal_each_request_alone_with_the_real_kernel(route_name):
    """The dense layout's sharing patterns (the CPU kit test's batch: pages 4 and 9 shared history slots, page 2 a
    shared page A continues, page 7 C's history that A writes): every request reads what it reads alone, and the real
    triton_sparse_mla computes the same output from its view."""
    route = ROUTES[route_name]
    case = BatchCase(
        PAGE, kit_capacity(*SHARED_SHAPE), ((4, 9, 2, 7), (4, 9, 2, 5), (7, 3)), (170, 192, 64), (50, 40, 30)
    )
    world = _world(route, SHARED_SHAPE, True)
    world.write_history(case)
    batch = world.forward(case)
    assert batch.kernel[0].output is not None, "triton_sparse_mla must run for real here"
    for r in range(case.num_requests):
        alone = BatchCase(PAGE, case.capacity, (case.page_tables[r],), (case.prefix_lens[r],), (case.extend_lens[r],))
        solo_world = _world(route, SHARED_SHAPE, True)
        solo_world.write_history(alone)
        solo = solo_world.forward(alone)
        start = sum(case.extend_lens[:r])
        rows = slice(start, start + case.extend_lens[r])
        for layer, (mine, own) in enumerate(zip(batch.kernel, solo.kernel)):
            assert same_bytes(mine.rows[rows], own.rows), f"request {r} layer {layer}: other rows than alone"
            assert torch.equal(mine.output[rows], own.output), f"request {r} layer {layer}: other output than alone"


def test_index_share_and_ragged_radix_hit_beyond_the_pool():
    route = KitRoute("triton_sparse_mla", fp8=True, skip_topk_layers=(False, True, False))
    capacity = kit_capacity(1, 256)
    case = BatchCase(PAGE, capacity, ((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 6)), (192, 192, 192), (30, 30, 30))
    off, on = _pair(route, case, (3, 256), pool_requests=1)
    assert sorted(on.index_k) == [0, 2]
    _assert_same(off, on, "IndexShare RAGGED radix hit")


@pytest.mark.parametrize("route_name", ["triton_sparse_mla-fp8-ragged", "flashmla_sparse-fp8-ragged"])
def test_ragged_no_prefix_chunk_and_its_continuation(route_name):
    """RAGGED chunk 1 has no cached prefix: the mode makes no dense latent view and writes the owned rows
    straight to the pool with upstream's FP8 writer; chunk 2 reads them back as history through the view."""
    from sglang_cpkv.hooks import dsa_extend

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
            state = getattr(world.backend, dsa_extend.STATE_ATTR, None)
            latent_bytes.append(0 if state is None else state.buffers.held_bytes(dsa_extend.LATENT))
        runs.append(forwards)
    assert latent_bytes[2] == 0 < latent_bytes[3], latent_bytes
    for i, (off, on) in enumerate(zip(*runs)):
        _assert_same(off, on, f"chunk {i + 1}")


def test_the_mode_adds_one_host_sync_per_batch():
    """CUDA sync-debug mode counts every synchronizing call of a forward (plan build included): the mode on adds
    exactly one to what upstream's own code does with it off, the plan's one host copy of the batch's page ids (the
    dense layout's shared history slots are a function of them; under CP the exchange's blocks too), and none per
    layer."""
    route = KitRoute("triton_sparse_mla")
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
    marker = next(i for i, line in enumerate(lines) if "The one host copy of a device page table" in line)
    assert counts[True][1] == [f"{source}:{marker + 2}"], f"host syncs in sglang_cpkv: {counts[True][1]}"
    print(f"synchronizing calls per forward: mode off {counts[False][0]}, mode on {counts[True][0]}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
