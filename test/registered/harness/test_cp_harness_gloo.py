"""The CP correctness harness on CPU: cp=1 in process and cp=2 over gloo, bs 1/2/4, every scenario.

Every request of every batch must be byte-equal to the same request run alone (attention outputs,
and its dense KV view after every forward, every layer) on every rank; the bs=1 goldens must agree
across cp and ranks; the negative control (the seed's 1-D value-keyed inverse, cp=1) must show a
request reading another request's marker on the collision class and be harmless on the reachable
class. Checked mode is on (every plan invariant and every remapped read is checked too).
"""

import os
import sys

os.environ["SGLANG_CPKV_OPS_BACKEND"] = "torch"

import pytest
import torch

from sglang_cpkv.harness import run_harness
from sglang_cpkv.harness.allocator import PrefixCachingAllocator
from sglang_cpkv.harness.compare import judge_run
from sglang_cpkv.harness.engine import run_batch, run_goldens
from sglang_cpkv.harness.model import ToyDsa, ToyDsaConfig
from sglang_cpkv.harness.scenarios import SCENARIO_NAMES, build_scenarios
from sglang_cpkv.runtime import SingleRankGroup
from sglang_cpkv.testing.batches import COLLISION, REACHABLE
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="cpkv-cpu")

BS_LIST = [1, 2, 4]


@pytest.fixture(scope="module")
def report():
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on the 2-core CI box
    return run_harness([1, 2], BS_LIST, list(SCENARIO_NAMES), "cpu", "torch", checked=True, log=lambda _: None)


def test_every_batch_request_byte_equal_to_its_bs1_golden(report):
    batches = [c for c in report["checks"] if c["check"] == "batch"]
    assert [c for c in batches if not c["passed"]] == []
    # cp=1 (one rank) and cp=2 (two ranks) x every scenario x every bs, each judged
    assert len(batches) == len(SCENARIO_NAMES) * len(BS_LIST) * 3
    assert {(c["cp"], c["rank"]) for c in batches} == {(1, 0), (2, 0), (2, 1)}
    classes = {(c["scenario"], c["state_class"]) for c in batches if c["bs"] >= 2}
    assert classes == {("radix", REACHABLE), ("collision_partial", COLLISION), ("collision_reuse", COLLISION)}
    assert all(c["forwards"] >= 2 for c in batches if c["scenario"] == "radix")  # chunked prefill


def test_goldens_agree_across_cp_and_ranks(report):
    goldens = [c for c in report["checks"] if c["check"] == "golden"]
    assert len(goldens) == len(SCENARIO_NAMES) * 2 and all(c["passed"] for c in goldens), goldens


def test_negative_control_contaminates_collision_class_only(report):
    controls = {(c["scenario"], c["bs"]): c for c in report["checks"] if c["check"] == "negative_control"}
    assert len(controls) == len(SCENARIO_NAMES) * len(BS_LIST)
    for c in controls.values():
        assert c["passed"], c
        if c["state_class"] == COLLISION:
            assert c["requests_contaminated"] and c["example"]["marker_of"] != c["example"]["request"], c
        else:
            assert c["requests_contaminated"] == [] and c["requests_unequal"] == [], c
    assert {s for (s, bs), c in controls.items() if c["state_class"] == COLLISION} == {
        "collision_partial",
        "collision_reuse",
    }
    assert report["summary"]["failed"] == 0


def test_judge_flags_a_planted_foreign_marker_and_a_changed_view():
    torch.set_num_threads(1)
    scenario = build_scenarios(2, 4)["collision_partial"]
    model = ToyDsa(ToyDsaConfig(num_layers=1), torch.device("cpu"))
    goldens = run_goldens(model, scenario, 2, SingleRankGroup(), torch.device("cpu"), False)
    run = run_batch(model, scenario, 2, SingleRankGroup(), torch.device("cpu"), "per_request", False)
    assert all(v.equal_to_golden and not v.contaminated for v in judge_run(run, goldens, scenario.marker_start))
    victim = run.requests[0]
    pos = scenario.marker_start[0]
    victim.reads[0, pos, 0] = goldens.requests[1].dense_views[-1][0, scenario.marker_start[1] + 1]
    victim.read_mask[0, pos, 0] = True
    run.requests[1].dense_views[-1][0, 3, 0] += 1
    verdicts = judge_run(run, goldens, scenario.marker_start)
    assert verdicts[0].foreign_marker_reads == [{"layer": 0, "position": pos, "marker_of": 1}]
    assert not verdicts[1].equal_to_golden and verdicts[0].equal_to_golden


def test_allocator_shares_whole_pages_or_partial_pages_by_mode():
    prompt = tuple(range(1, 11))  # 10 tokens, page size 4: 2 whole pages + 2 tokens
    radix = PrefixCachingAllocator(16, 4, share_partial_pages=False, seed=0)
    first = radix.admit(prompt)
    radix.insert(prompt, first.pages)
    again = radix.admit(prompt + (99, 98))
    assert again.cached_len == 8 and again.pages[:2] == first.pages[:2] and first.pages[2] not in again.pages
    partial = PrefixCachingAllocator(16, 4, share_partial_pages=True, seed=0)
    first = partial.admit(prompt)
    partial.insert(prompt, first.pages)
    again = partial.admit(prompt + (99, 98))
    assert again.cached_len == 10 and again.pages == first.pages  # continues the shared partial page
    reused = partial.admit((50, 51), reuse_page=first.pages[1])
    assert reused.cached_len == 0 and reused.pages == (first.pages[1],)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
