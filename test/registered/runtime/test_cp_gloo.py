"""cp=2 and cp=4 in real processes over gloo: dense views byte-equal to cp=1.

Each rank's pool holds only the pages it owns (``page_id % cp``; the rest is poisoned), history
pages reach every rank's dense view through the page all-gather, and the current KV through the
all-gather of the rank's split rows. Every rank's whole dense buffer must be byte-equal to the
cp=1 run's (unwritten rows are poisoned identically), every top-k read must match the truth, and
the union of the ranks' owned pages must equal the cp=1 pool after the current rows are persisted.
"""

import os
import random
import sys

os.environ["SGLANG_CPKV_OPS_BACKEND"] = "torch"

import pytest
import torch

from sglang_cpkv.testing.batches import (
    BatchCase,
    check_against_truth,
    host_plan,
    make_pool_and_current,
    owned_pool_rows,
    random_case,
    random_topk,
    run_case_on_ranks,
    same_bytes,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.cp_dist import spawn_cp_ranks

register_cpu_ci(est_time=60, suite="cpkv-cpu")


def _cases(cp):
    fixed = [
        # the seed's [[1,5],[9,5]] shared partial page with divergent current writes (collision class)
        BatchCase(4, 16, ((1, 5), (9, 5)), (5, 5), (2, 2), cp, "interleave"),
        # shared full prefix page + a request continuing its own partial page (reachable class)
        BatchCase(4, 16, ((3, 7, 2), (3, 8), (11, 12)), (6, 4, 0), (5, 3, 7), cp, "interleave"),
        BatchCase(2, 24, ((3, 7, 2, 9, 10, 13, 18), (3, 7, 14, 15, 16, 17, 19)), (5, 4), (9, 10), cp, "zigzag"),
    ]
    rng = random.Random(100 + cp)
    randoms = [random_case(rng, max_cp=1) for _ in range(6)]
    randoms = [c.on_cp(cp, ("interleave", "zigzag")[i % 2]) for i, c in enumerate(randoms)]
    payloads = []
    for i, case in enumerate(fixed + randoms):
        dtype, width = ((torch.bfloat16, 8), (torch.uint8, 12))[i % 2]
        pool, current = make_pool_and_current(case, dtype, width, seed=i)
        topk, positions = random_topk(case, 5, seed=i)
        payloads.append((case, pool, current, topk, positions))
    return payloads


@pytest.mark.parametrize("cp", [2, 4])
def test_gloo_ranks_equal_cp1(cp):
    cases = _cases(cp)
    results = spawn_cp_ranks(cp, [(c, pool, cur, topk) for c, pool, cur, topk, _ in cases])
    strategies = set()
    for i, (case, pool, current, topk, positions) in enumerate(cases):
        strategies.add(case.effective_strategy)
        single = case.on_cp(1)
        [cp1] = run_case_on_ranks(single, pool, current, topk)
        plan1 = host_plan(single, 0)
        view1 = torch.cat([cp1.dense[plan1.request_locations(r)] for r in range(case.num_requests)])
        for rank in range(cp):
            got = results[rank][i]
            plan = host_plan(case, rank)  # under CP the history region is ordered by owner, at cp 1 by page id
            view = torch.cat([got.dense[plan.request_locations(r)] for r in range(case.num_requests)])
            assert same_bytes(view, view1), f"case {i} rank {rank}: a request's view differs from cp=1 ({case})"
            assert same_bytes(got.current_full, current)
        # Reads, request ids and pool writes against the truth.
        rank_results = [results[k][i] for k in range(cp)]
        assert check_against_truth(case, pool, current, positions, rank_results) == [], case
        locs = case.out_cache_loc()
        if len(set(locs)) == len(locs):  # duplicate locations: the pool winner is unspecified
            union = torch.empty_like(pool)  # every rank's pool rows back at their token locations
            for rank in range(cp):
                union[owned_pool_rows(case, rank)] = results[rank][i].pool_after
            assert same_bytes(union, cp1.pool_after), f"case {i}: owned pools differ from the cp=1 pool"
    assert {"interleave", "zigzag"} <= strategies, strategies


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
