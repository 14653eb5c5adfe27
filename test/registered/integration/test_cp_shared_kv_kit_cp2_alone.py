"""Each request of a cp 2 batch reads what it reads alone at cp 2, and an MTP draft beside its target at cp 2 (CPU).

Split from ``test_cp_shared_kv_kit.py`` (its docstring: the kit, the routes, what "reads" means); the batches and the
rank worker are :mod:`sglang_cpkv.testing.kit_cases` (part ``"alone"``: both ranks run the collision-class sharing
batch on five routes and the RAGGED batch with a history-less request, mode on, each request of them alone, and the
MTP draft's extend beside its target's, once for the module). That the same batches read the same KV with the mode
off is ``test_cp_shared_kv_kit_cp2.py``.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.batches import same_bytes
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import assert_reads_alone, request_reads
from sglang_cpkv.testing.kit_cases import (
    CP,
    RAGGED_FP8,
    SHARING_CP2_ROUTES,
    alone_case,
    assert_cp2_reads_alone,
    assert_same_reads,
    cp2_scenarios,
    run_part,
    shared_prefix_case,
    sharing_case,
)

register_cpu_ci(est_time=125, suite="cpkv-cpu")


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_part("alone", tmp_path_factory.mktemp("kit_cp2_alone"))


@pytest.mark.parametrize("name", list(SHARING_CP2_ROUTES))
def test_cp2_sharing_patterns_read_what_each_request_reads_alone(gloo_results, name):
    """The collision-class sharing batch at cp 2 (both ranks' query rows together) reads, at every position of every
    request, what that request reads alone at cp 2: shared history slots gathered in place, CURRENT_REUSE and reused
    pages in own slots."""
    assert_cp2_reads_alone(gloo_results, name, sharing_case(CP), SHARING_CP2_ROUTES[name].num_layers)


def test_cp2_an_mtp_draft_extends_through_the_mode_beside_its_target(gloo_results):
    """At cp 2 over gloo the draft's extend (RAGGED FP8) runs after its target's on each rank through the one exchange
    group: both read what they read with the mode off, each rank's draft pool holds the replica's owned pages, and
    on the sharing batch (collision class) each request's draft reads what it reads alone at cp 2."""
    capacity = shared_prefix_case(CP).capacity
    for rank, results in enumerate(gloo_results):
        off, on = results[("mtp-draft", False)], results[("mtp-draft", True)]
        for world, what in ((0, "target"), (1, "draft")):
            assert_same_reads(off[world], on[world], f"rank {rank} {what}")
        mine, replica = on[1].pool_after[0].reshape(capacity // CP, -1), off[1].pool_after[0].reshape(capacity, -1)
        assert same_bytes(mine, replica[torch.arange(capacity // CP) * CP + rank]), f"rank {rank}: the draft's pool"
    sharing = sharing_case(CP)
    batch = request_reads([(results[("mtp-draft sharing", None)], sharing) for results in gloo_results])
    alone = {}
    for r in range(sharing.num_requests):
        runs = [(results[("mtp-draft sharing", r)], alone_case(sharing, r)) for results in gloo_results]
        alone.update({(r, p): v for (_, p), v in request_reads(runs).items()})
    assert_reads_alone(batch, alone, "the draft at cp 2")


def test_cp2_ragged_requests_read_what_they_read_alone(gloo_results):
    """At cp 2 on the RAGGED route, the history-less C beside A's and B's radix hit reads, on both ranks, what it
    reads alone (its chunk's bf16 keys, the all-gathered chunk), and so do A and B (their cache rows); the mode off
    reads the same rows (test_cp_shared_kv_kit_cp2.py::test_cp2_each_rank_reads_the_same_kv_with_the_mode_on)."""
    name = "shared-ragged"
    case = next(cases[0] for n, _, cases, _ in cp2_scenarios() if n == name)
    assert case.prefix_lens[2] == 0 and case.prefix_lens[0] > 0
    assert_cp2_reads_alone(gloo_results, name, case, RAGGED_FP8.num_layers)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
