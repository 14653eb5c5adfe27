"""Every kit scenario at cp 2 over gloo, mode off and on: upstream's DSA kit through the patched backend (CPU).

Split from ``test_cp_shared_kv_kit.py`` (its docstring: the kit, the routes, what "reads" means); the scenarios and
the rank worker are :mod:`sglang_cpkv.testing.kit_cases` (part ``"scenarios"``: both ranks run every scenario with
the mode off and on, once for the module). Each rank reads the same KV with the mode on as off; with the mode on its
pool holds only its owned pages, the replica's bytes; the page tables are upstream's page-interleave allocator's; the
mode holds its reservation and reads the host once per batch. Each request against its run alone at cp 2:
``test_cp_shared_kv_kit_cp2_alone.py``.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.batches import same_bytes
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.host_reads import HOST_MEMORY_READS
from sglang_cpkv.testing.kit_cases import (
    CP,
    SHARING_CP2_ROUTES,
    allocator_case,
    assert_same_reads,
    cp2_scenarios,
    run_part,
    scenario_case,
)

register_cpu_ci(est_time=110, suite="cpkv-cpu")


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_part("scenarios", tmp_path_factory.mktemp("kit_cp2"))


def test_cp2_exchange_group_made_by_the_patched_model_parallel_init(gloo_results):
    for rank, results in enumerate(gloo_results):
        assert results["group"] == (CP, rank, True)


@pytest.mark.parametrize("name", [s[0] for s in cp2_scenarios() if s[0] not in SHARING_CP2_ROUTES])
def test_cp2_each_rank_reads_the_same_kv_with_the_mode_on(gloo_results, name):
    for rank, results in enumerate(gloo_results):
        off, on = results[(name, False)][0], results[(name, True)][0]
        for forward, (a, b) in enumerate(zip(off, on)):
            assert_same_reads(a, b, f"{name} rank {rank} forward {forward}")


def test_cp2_allocator_page_tables_come_from_its_owner_classes(gloo_results):
    """The batch is what it claims: its page ids are the page-interleave allocator's, none reserved, each chain's
    pages cycling through the owner classes from its rotation base (A and B the prefix chain's), the prefix pages
    shared; every rank's mode-on world holds that allocator (built by the mode's hook) and it hands out the same."""
    case, bases = allocator_case()
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
    case = scenario_case(name, 0)
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
    case = next(cases for name, _, cases, _ in cp2_scenarios() if name == "dropped-paged")[0]
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
            history = any(p > 0 for p in scenario_case(key[1], key[3]).prefix_lens)
            assert ours == ({"runtime.plan:build_plan": 1} if history else {}), (key, counts)


def test_cp2_mtp_seed_export_maps_to_pool_locations(gloo_results):
    """Regression d: the seed of a no-prefix RAGGED CP-cut batch holds the same pool locations with the mode
    on as off (it mapped dense top-k through out_cache_loc, pool locations, and counted them as bad)."""
    for results in gloo_results:
        off, on = results[("ragged-no-prefix-cut", False)][1], results[("ragged-no-prefix-cut", True)][1]
        assert torch.equal(off, on) and bool((on >= 0).any())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
