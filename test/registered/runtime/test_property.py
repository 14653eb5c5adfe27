"""Property test: random batches through the runtime equal the brute-force per-request truth.

Every generated batch (page sharing, shared partially filled pages, colliding page ids, partial
pages, chunked continuation, bs 1..8, cp 1..8 with interleave/zigzag splits and owner-sharded
pools, bf16 and byte rows, layer-ahead and synchronous) runs through the runtime's layer pipeline on
every CP rank in one process (threads in lockstep, :mod:`sglang_cpkv.testing.lockstep`); each
request's dense view, every top-k read and every pool write must equal the truth
(:mod:`sglang_cpkv.testing.batches`). Each case is labelled with its contract state class
(hypothesis ``event``); both classes must be well represented.

The negative control: the seed's 1-D value-keyed inverse fails the same read property on the
collision class and is harmless (identical copies) on the reachable class.

The ops run on the torch reference here (2,000 batches would take too long in the Triton
interpreter; the kernels have their own parity tests against the reference).
"""

import os
import random
import sys
from collections import Counter

os.environ["SGLANG_CPKV_OPS_BACKEND"] = "torch"

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sglang_cpkv.testing.batches import (
    COLLISION,
    HISTORY_WRITTEN,
    REACHABLE,
    SHARED_HISTORY,
    SHARED_REUSE,
    batch_cases,
    check_against_truth,
    make_pool_and_current,
    random_case,
    random_topk,
    run_case_on_ranks,
    sharing_patterns,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.value_keyed_inverse import value_keyed_read_mismatches

register_cpu_ci(est_time=45, suite="cpkv-cpu")

torch.set_num_threads(1)  # tiny tensors: thread start-up costs more than it saves
PROPERTY_EXAMPLES = 2000
CLASS_COUNTS: Counter = Counter()


@settings(
    max_examples=PROPERTY_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    case=batch_cases(),
    row_kind=st.sampled_from(["bf16", "bytes"]),
    seed=st.integers(0, 2**16),
    checked=st.booleans(),
    layer_ahead=st.booleans(),
)
def _property(case, row_kind, seed, checked, layer_ahead):
    event(case.state_class)
    CLASS_COUNTS[case.state_class] += 1
    CLASS_COUNTS[f"cp{case.cp_size}"] += 1
    for pattern in sharing_patterns(case):
        event(pattern)
        CLASS_COUNTS[pattern] += 1
    dtype, width = (torch.bfloat16, 6) if row_kind == "bf16" else (torch.uint8, 10)
    pool, current = make_pool_and_current(case, dtype, width, seed)
    topk, positions = random_topk(case, 4, seed)
    # checked mode on about one case in eight: it adds host syncs and invariant checks per op.
    results = run_case_on_ranks(
        case,
        pool,
        current,
        topk,
        checked=checked and seed % 4 == 0,
        layer_ahead=layer_ahead,
    )
    problems = check_against_truth(case, pool, current, positions, results)
    assert problems == [], f"{case.state_class} case {case}: {problems[:5]}"


def test_runtime_equals_per_request_truth_on_random_batches():
    CLASS_COUNTS.clear()
    _property()
    print(f"generated batches by class and cp: {dict(CLASS_COUNTS)}")
    total = CLASS_COUNTS[REACHABLE] + CLASS_COUNTS[COLLISION]
    assert total >= PROPERTY_EXAMPLES
    assert CLASS_COUNTS[REACHABLE] >= total // 20 and CLASS_COUNTS[COLLISION] >= total // 5, CLASS_COUNTS
    assert all(CLASS_COUNTS[f"cp{cp}"] > 0 for cp in range(1, 9)), CLASS_COUNTS
    # The sharing patterns the shared history slots must keep apart (testing/batches.py, sharing_patterns).
    assert all(CLASS_COUNTS[p] >= total // 20 for p in (SHARED_HISTORY, HISTORY_WRITTEN, SHARED_REUSE)), CLASS_COUNTS


def _control_cases(state_class, count, seed):
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        case = random_case(rng, max_cp=1)
        if case.state_class == state_class:
            cases.append(case)
    return cases


def test_value_keyed_control_fails_on_the_collision_class():
    failing = 0
    cases = _control_cases(COLLISION, 200, seed=11)
    for i, case in enumerate(cases):
        pool, current = make_pool_and_current(case, torch.uint8, 8, seed=i)
        topk, positions = random_topk(case, 6, seed=i)
        failing += bool(value_keyed_read_mismatches(case, pool, current, topk, positions))
        # The per-request runtime passes the very same reads.
        assert check_against_truth(case, pool, current, positions, run_case_on_ranks(case, pool, current, topk)) == []
    assert failing >= len(cases) // 4, f"the 1-D control failed only {failing} of {len(cases)} collision-class batches"


def test_value_keyed_control_is_harmless_on_the_reachable_class():
    cases = _control_cases(REACHABLE, 200, seed=12)
    shared = 0
    for i, case in enumerate(cases):
        pages = [p for t in case.page_tables for p in t]
        shared += len(pages) != len(set(pages))
        pool, current = make_pool_and_current(case, torch.uint8, 8, seed=i)
        topk, positions = random_topk(case, 6, seed=i)
        assert value_keyed_read_mismatches(case, pool, current, topk, positions) == [], case
    assert shared >= 20, "too few reachable cases actually share a page"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
