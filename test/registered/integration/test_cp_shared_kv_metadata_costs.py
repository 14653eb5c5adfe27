"""What the mode adds to a batch's metadata in upstream's DSA backend: no host read and no second page table.

Host reads (issue 53 item 1): every host read of one batch's ``init_forward_metadata``, upstream's frames included, mode
off vs on, per route (PAGED, RAGGED on both FP8 routes; a shared cached prefix, distinct ones, none).

``HostReadCounter(every_frame=True)`` counts ``item``/``tolist``/``bool``/``int``/``float``/``cpu``/``numpy`` of a
tensor wherever they are called: ours in ``counts`` (``module:function``), upstream's in ``others``
(``path:function``). On a CPU a read of a host mirror (``seq_lens_cpu``) counts like a device read, so upstream's frames
are compared mode off vs on (the mode adds none: it knows its bounds on the host) and ours against the plan's one
documented copy (the history page ids, ``runtime.plan:build_plan``, only when some request has history). Before the
fix a RAGGED batch sharing a cached prefix took one more read in upstream's ``init_forward_metadata``: the capacity
check's ``page_table_1_flattened.max().item()``, as ``seq_lens_sum`` (446) passed the dense view's rows (384).

The page table (issue 53 item 2): the mode remaps upstream's ``[rows, max_seqlen_k]`` table in place (its own copy, read
as pool locations by nothing after the hook), so a batch holds no second table, which the reservation could not bound
(rows x the longest request: one 190K-token prefix beside 2,230 one-token requests is 0.8 GiB a rank at cp 2).
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="cpkv-cpu")

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

from sglang_cpkv.testing.batches import BatchCase  # noqa: E402
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, kit_capacity  # noqa: E402
from sglang_cpkv.testing.host_reads import HostReadCounter  # noqa: E402
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse)

SHAPE = (3, 300)
_CAP = kit_capacity(*SHAPE)
CASES = {
    # A and B share a 2-page cached prompt (pages 4, 9): seq_lens_sum counts it twice, the dense view once.
    "shared-prefix": BatchCase(PAGE, _CAP, ((4, 9, 2), (4, 9, 5), (11, 3)), (128, 128, 0), (60, 50, 80)),
    "distinct-prefix": BatchCase(PAGE, _CAP, ((4, 9, 2), (6, 8, 5), (11, 3)), (128, 100, 0), (60, 50, 80)),
    "no-prefix": BatchCase(PAGE, _CAP, ((4, 9), (6, 8), (11, 3)), (0, 0, 0), (60, 50, 80)),
}
ROUTES = {
    "paged-bf16": KitRoute("flashmla_sparse"),
    "ragged-fp8-flashmla_sparse": KitRoute("flashmla_sparse", fp8=True),
    "ragged-fp8-triton_sparse_mla": KitRoute("triton_sparse_mla", fp8=True),
}


def _metadata_reads(route, case, mode_on):
    world = KitWorld(route, max_requests=SHAPE[0], longest=SHAPE[1], mode_on=mode_on, device="cpu")
    world.write_history(case)
    forward_batch = world._extend_batch(case)[0]
    with torch.no_grad(), world.up["context"](world.backend), HostReadCounter(every_frame=True) as reads:
        world.backend.init_forward_metadata(forward_batch)
    return reads, world, forward_batch


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("route_name", list(ROUTES))
def test_the_mode_adds_no_host_read_to_a_batch_metadata(route_name, case_name):
    route, case = ROUTES[route_name], CASES[case_name]
    off, _, _ = _metadata_reads(route, case, False)
    on, world, forward_batch = _metadata_reads(route, case, True)
    assert on.others == off.others, (route_name, case_name, dict(off.others), dict(on.others))
    history = any(case.prefix_lens)
    assert dict(on.syncs()) == ({"runtime.plan:build_plan": 1} if history else {}), dict(on.counts)
    if case_name == "shared-prefix":  # the state of the issue: upstream's bound alone would read the device
        assert forward_batch.seq_lens_sum > world.backend.cp_shared_kv.batch.plan.dense_rows


@pytest.mark.parametrize("route_name", ["paged-bf16", "ragged-fp8-flashmla_sparse"])
def test_the_remapped_page_table_is_upstreams_own(route_name, monkeypatch):
    from sglang_cpkv.hooks import dsa_metadata

    handed = []
    original = dsa_metadata.remap_page_table

    def record(batch, page_table, bs_idx):
        handed.append((page_table.untyped_storage().data_ptr(), page_table.clone()))
        return original(batch, page_table, bs_idx)

    monkeypatch.setattr(dsa_metadata, "remap_page_table", record)
    case = CASES["shared-prefix"]
    world = KitWorld(ROUTES[route_name], max_requests=SHAPE[0], longest=SHAPE[1], mode_on=True, device="cpu")
    world.write_history(case)
    world.forward(case)
    ((storage, pool_locs),) = handed
    table = world.backend.forward_metadata.page_table_1
    assert table.untyped_storage().data_ptr() == storage, "the mode allocated a second page table"
    batch = world.backend.cp_shared_kv.batch
    expected = batch.pipeline.remap(pool_locs, torch.arange(table.shape[0]))  # out of place, from the copy
    assert torch.equal(table, expected) and int(table.max()) < batch.plan.dense_rows


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
