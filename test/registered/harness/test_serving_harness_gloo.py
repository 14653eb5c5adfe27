"""The serving-path harness on CPU: upstream's DSA attention kit through the patched backend at cp 2 over gloo.

Two ranks, each a process with upstream's distributed init and the patched model-parallel groups; bs 2; every
scenario (radix hits with CURRENT_REUSE, a chunked continuation whose history the mode persisted
owner-sharded, the dense layout's three sharing patterns); the PAGED bf16 route of ``triton_sparse_mla`` (captured: the interpreter cannot run its bf16
products). Every check of the report must pass: the kernel reads the same KV bytes with the mode on
as off, each request of the batch reads what it reads alone, and the ranks' dense views are byte-equal. The
judge is shown to fail on a planted fault of each kind. The command line an operator runs
(``scripts/run_cp_harness.py``) writes the report and exits by its checks.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from sglang_cpkv.harness import serving
from sglang_cpkv.testing.batches import HISTORY_WRITTEN, SHARED_HISTORY, SHARED_REUSE, sharing_patterns
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="cpkv-cpu")

# The PAGED bf16 route: on CPU upstream's FP8 writers run in the Triton interpreter (about 40 s a scenario here);
# the RAGGED FP8 route at cp 2 over gloo is test_cp_shared_kv_kit_cp2*.py's, every route runs in the GPU suites.
JOB = serving.HarnessJob(routes=("triton_sparse_mla-bf16-paged",), scenarios=serving.SCENARIO_NAMES, bs_list=(2,))


@pytest.fixture(scope="module")
def ranks():
    return serving.run_ranks(JOB, 2, "cpu", log=print)


def test_every_check_passes_at_cp2(ranks):
    checks = serving.judge(JOB, 2, ranks)
    assert [c for c in checks if not c["passed"]] == []
    # mode_off, bs1, ranks; no mode_off where upstream's own path cannot serve the batch
    assert len(checks) == len(JOB.routes) * (len(JOB.scenarios) * 3 - len(serving.UPSTREAM_CANNOT_SERVE))
    for c in checks:
        assert c["rows"] == sum(sum(case.extend_lens) for case in serving.scenarios(2, 2, 2)[c["scenario"]].forwards)


def test_the_scenarios_are_what_they_claim():
    shared = serving.scenarios(2, 2, 2)["shared-prefix"].forwards[0]
    assert shared.page_tables[0][:2] == shared.page_tables[1][:2]  # a radix hit on two shared pages
    assert shared.prefix_lens[1] % serving.PAGE != 0  # a history that ends mid-page, continued by the chunk
    chunk1, chunk2 = serving.scenarios(2, 2, 2)["chunked"].forwards
    assert list(chunk2.prefix_lens) == [p + e for p, e in zip(chunk1.prefix_lens, chunk1.extend_lens)]
    assert any(p % serving.PAGE for p in chunk2.prefix_lens)
    for bs in (2, 4):
        sharing = serving.scenarios(bs, 2, bs)["sharing"].forwards[0]
        assert sharing_patterns(sharing) == {SHARED_HISTORY, SHARED_REUSE, HISTORY_WRITTEN}


def _planted(ranks, key, mutate):
    planted = copy.deepcopy(ranks)
    mutate(planted[1][key])
    return {(c["route"], c["scenario"], c["check"]) for c in serving.judge(JOB, 2, planted) if not c["passed"]}


def test_the_judge_fails_on_a_planted_fault_of_each_kind(ranks):
    route, scenario = JOB.routes[0], "chunked"

    def other_bytes(run):  # one KV byte a row reads with the mode on, on rank 1
        rows, _valid, _out = next(iter(run.reads.values()))[0]
        rows[0, 0] ^= 1

    def other_view(run):
        run.dense_views[-1]["latent"][0, 0] ^= 1

    assert _planted(ranks, (route, scenario, 2, "on"), other_bytes) == {
        (route, scenario, "mode_off"),
        (route, scenario, "bs1"),
    }
    assert _planted(ranks, (route, scenario, 2, 1), other_bytes) == {(route, scenario, "bs1")}
    assert _planted(ranks, (route, scenario, 2, "on"), other_view) == {(route, scenario, "ranks")}


def test_the_command_line_writes_the_report_and_exits_by_its_checks(tmp_path):
    script = Path(__file__).resolve().parents[3] / "scripts" / "run_cp_harness.py"
    out = tmp_path / "harness.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command sets it for --device cpu
    argv = ["--cp", "1", "--bs-list", "2", "--routes", JOB.routes[0], "--scenarios", "shared-prefix", "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, str(script), *argv, "--out", str(out)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["summary"] == {
        "checks": 2,
        "passed": 2,
        "failed": 0,
        "by_kind": {"bs1": {"passed": 1, "total": 1}, "mode_off": {"passed": 1, "total": 1}},
    }
    assert report["command"].startswith("run_cp_harness.py --cp 1") and report["dist_backend"] == "gloo"
    bad = subprocess.run(
        [sys.executable, str(script), "--routes", "no-such-route"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--routes: unknown ['no-such-route']" in bad.stderr and "Traceback" not in bad.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
