"""The dense layout's sharing patterns and an MTP draft beside its target, through upstream's DSA kit at cp 1 (CPU).

Split from ``test_cp_shared_kv_kit.py`` (its docstring: the kit, the routes, what "reads" means) to keep each file a
few minutes on the 2-core CI machine; the batches and routes are :mod:`sglang_cpkv.testing.kit_cases`. The
collision-class sharing batch is compared, request by request and layer by layer, with each request's run alone; the
draft's extend runs through the mode as a second backend.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.batches import same_bytes
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import KitRoute, assert_reads_alone, request_reads
from sglang_cpkv.testing.kit_cases import (
    INDEX_SHARE,
    ROUTES,
    SHARED_SHAPE,
    alone_case,
    assert_same_reads,
    draft_extend,
    kit_world,
    rows_of_request,
    run_alone,
    shared_prefix_case,
    sharing_case,
    target_and_draft,
)

register_cpu_ci(est_time=110, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)


@pytest.mark.parametrize("route_name", [*ROUTES, "flashmla_sparse-fp8-ragged-indexshare"])
def test_sharing_patterns_read_what_each_request_reads_alone(route_name):
    from sglang_cpkv.testing.batches import HISTORY_WRITTEN, SHARED_HISTORY, SHARED_REUSE, sharing_patterns

    route = ROUTES.get(route_name) or KitRoute("flashmla_sparse", fp8=True, skip_topk_layers=INDEX_SHARE)
    case = sharing_case()
    assert sharing_patterns(case) == {SHARED_HISTORY, SHARED_REUSE, HISTORY_WRITTEN}
    world = kit_world(route, SHARED_SHAPE, True)
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
    solo_runs = [(run_alone(route, case, r), alone_case(case, r)) for r in range(case.num_requests)]  # every layer
    for layer in range(route.num_layers):
        alone = {}
        for r, (run, solo_case) in enumerate(solo_runs):
            alone.update({(r, p): v for (_, p), v in request_reads([(run, solo_case)], layer).items()})
        assert_reads_alone(request_reads([(batch, case)], layer), alone, f"{route_name} layer {layer}")
    for layer in batch.index_k:  # the indexer read each request's own history too (dense index-K pages)
        assert batch.index_k[layer]


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
    case = shared_prefix_case()
    worlds, runs = {}, {}
    for mode_on in (False, True):  # mode on last: its reservation (backends=2) is the one published below
        worlds[mode_on] = target_and_draft(route, SHARED_SHAPE, mode_on)
        runs[mode_on] = draft_extend(*worlds[mode_on], case)
    for world, what in ((0, "target"), (1, "draft")):
        assert_same_reads(runs[False][world], runs[True][world], f"{route_name} {what}")
    assert same_bytes(runs[False][1].pool_after[0], runs[True][1].pool_after[0]), "the draft's pool differs"
    target, draft = worlds[True]
    reserved = published()
    per_backend = (reserved.total_bytes - reserved.backends * reserved.parts()["batch plan"]) // reserved.backends
    states = [getattr(world.backend, dsa_batch.STATE_ATTR) for world in (target, draft)]
    assert states[0] is not states[1] and states[1].batch.plan.num_requests == case.num_requests
    assert [state.buffers.held_bytes("") for state in states] == [per_backend, per_backend]
    for r in range(case.num_requests):
        solo_target, solo_draft = target_and_draft(route, SHARED_SHAPE, True)
        solo = draft_extend(solo_target, solo_draft, alone_case(case, r))[1]
        rows, valid = rows_of_request(runs[True][1], case, r)
        assert torch.equal(valid, solo.kernel[0].valid)
        assert same_bytes(rows, solo.kernel[0].rows), f"draft request {r} reads other rows in the batch than alone"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
