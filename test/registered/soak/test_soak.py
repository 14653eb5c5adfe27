"""The soak (``python -m sglang_cpkv.soak``): the CI soak passes, and what it reproduces of upstream stays upstream's.

* the CI soak (cp 1 and cp 2 over gloo, the real Mooncake transfer to a decode server, aborts of every kind) runs as
  ``make test`` runs it and its report shows requests served and aborted, reads checked, bytes transferred, and no
  mismatch, leak or crash;
* the scheduler the soak builds without ``__init__`` takes ``Scheduler.__init__``'s steps in upstream's order
  (:data:`sglang_cpkv.soak.server.INIT_STEPS`), and its stand-in model the eager runner's order of the CP split, the
  backend's metadata and the layers: a test fails when upstream's source moves;
* the KV function's FP8 forms are byte for byte what upstream's writers make of the soak's rows (its Triton
  quantizers, run in the interpreter), so a mismatch the soak reports is a wrong read, never a wrong expectation;
* the report fails a scenario for a leak, an unexpected ending, a request that did not end, a crash.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=165, suite="cpkv-cpu")

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

from sglang_cpkv.soak import kv_function, report  # noqa: E402
from sglang_cpkv.soak.server import INIT_STEPS, ServerConfig  # noqa: E402
from sglang_cpkv.soak.workload import Abort, WorkloadConfig, make_workload  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ci_report(tmp_path_factory):
    """The CI soak, run as ``make test`` runs it (its own processes, the interpreter's Triton)."""
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "sglang_cpkv.soak", "--ci", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = [line for line in run.stdout.splitlines() if line.startswith("[soak]")]
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    whole = json.loads(out.read_text())
    problems = [p for s in whole["scenarios"] for p in s["problems"]]
    assert run.returncode == 0, "\n".join(summary + problems[:10])
    return whole


def test_the_ci_soak_serves_aborts_checks_and_transfers_with_nothing_wrong(ci_report):
    totals = ci_report["totals"]
    assert ci_report["passed"]
    assert totals["mismatches"] == totals["leaks"] == totals["crashes"] == 0
    assert set(totals["requests_by_cp"]) == {"1", "2"}
    assert totals["served"] > 0 and totals["aborted"] > 0
    assert totals["reads_checked"] > 100_000 and totals["index_k_rows_checked"] > 0 and totals["pool_rows_checked"] > 0
    assert totals["transferred_bytes"] > 0
    kinds = {kind for s in ci_report["scenarios"] for kind in s["figures"]["aborts_by_queue"]}
    assert kinds == {kind.value for kind in Abort}, kinds
    for scenario in ci_report["scenarios"]:
        figures = scenario["figures"]
        assert figures["served"] + figures["aborted"] == figures["requests"], scenario["label"]
        assert figures["mode_host_syncs_max_per_batch"] <= 1
        assert 0 < figures["dense_slots_max"] <= figures["dense_slots_reserved"]


def _self_calls(function) -> list[str]:
    """The ``self.X(...)`` calls and the cache builder's call of a method, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "self":
                calls.append((node.lineno, node.col_offset, node.func.attr))
            elif isinstance(owner, ast.Name) and owner.id == "kv_cache_builder":
                calls.append((node.lineno, node.col_offset, f"kv_cache_builder.{node.func.attr}"))
    return [name for *_, name in sorted(calls)]


def test_the_scheduler_is_built_in_the_order_of_scheduler_init():
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    from sglang.srt.managers.scheduler import Scheduler

    assert _self_calls(Scheduler.__init__) == [step for step, _ in INIT_STEPS]
    for step, disposition in INIT_STEPS:
        assert disposition == "call" or disposition.startswith(("soak: ", "skip: ")), step
        if disposition == "call":
            assert callable(getattr(Scheduler, step)), step


def test_the_stand_in_model_runs_the_eager_runners_extend_order():
    """``EagerRunner._execute_extend``: the CP split (``is_cp_active``, ``prepare_cp_forward``), the backend's
    ``init_forward_metadata``, then the layers; the soak's worker calls the same functions in that order."""
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    from sglang_cpkv.soak.model import StandInWorker

    def order(function, names):
        source = inspect.getsource(function)
        found = [(source.find(f"{name}("), name) for name in names]
        assert all(at >= 0 for at, _ in found), (function.__qualname__, found)
        return [name for _, name in sorted(found)]

    steps = ["is_cp_active", "prepare_cp_forward", "init_forward_metadata", "forward_context"]
    assert order(EagerRunner._execute_extend, steps) == steps
    assert order(StandInWorker.forward_batch_generation, steps) == steps


@pytest.mark.parametrize("layer", [0, 1])
def test_the_kv_functions_fp8_forms_are_upstreams_writers(layer):
    """The packed latent row and the index key as upstream's Triton quantizers make them of the soak's rows (the
    interpreter here), and the dequantized row as the bf16 one (the soak's values are exact in FP8)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    from sglang.kernels.ops.quantization.act_quant_triton import act_quant
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate

    hashes = torch.tensor(kv_function.prefix_hashes(range(40)) + kv_function.prefix_hashes(range(7, 47)))
    k_nope, k_rope = kv_function.latent_rows(hashes, layer)
    nope_part, rope_part = quantize_k_cache_separate(k_nope, k_rope)
    upstream = torch.cat([nope_part.squeeze(1), rope_part.squeeze(1)], dim=1)
    assert torch.equal(upstream, kv_function.packed_fp8_rows(k_nope, k_rope))
    assert torch.equal(kv_function.dequantized_rows(upstream), torch.cat([k_nope, k_rope], dim=1))
    keys = kv_function.index_keys(hashes, layer)
    q, s = act_quant(keys.contiguous(), 128, None)
    want_q, want_s = kv_function.index_k_fp8(keys)
    assert torch.equal(q.view(torch.uint8), want_q) and torch.equal(s.reshape(-1), want_s)
    # rows of different prefixes differ in every form
    assert not torch.equal(upstream[0], upstream[40])


def test_the_cpu_kernels_write_what_upstreams_write():
    """The torch forms the soak takes on a CPU (:mod:`sglang_cpkv.soak.cpu_kernels`) against upstream's Triton kernels
    in the interpreter, on the soak's rows: the latent quantizer, the index key's, and the index-K store (every byte
    of the pages it writes; locations across pages, offsets 0 and 63)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    from sglang.kernels.ops.kvcache import dsa_index_k_cache
    from sglang.kernels.ops.quantization import act_quant_triton, dsa_quant_k_cache

    from sglang_cpkv.soak import cpu_kernels

    hashes = torch.tensor(kv_function.prefix_hashes(range(70)))
    k_nope, k_rope = kv_function.latent_rows(hashes, 1)
    for ours, theirs in zip(
        cpu_kernels.latent_fp8(k_nope, k_rope), dsa_quant_k_cache._quantize_k_cache_fast_separate(k_nope, k_rope)
    ):
        assert torch.equal(ours, theirs)
    keys = kv_function.index_keys(hashes, 1)
    for ours, theirs in zip(cpu_kernels.index_key_fp8(keys), act_quant_triton.act_quant(keys.contiguous(), 128, None)):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8))
    q, scale = act_quant_triton.act_quant(keys.contiguous(), 128, None)
    loc = torch.tensor([64 * p + o for p, o in zip(range(1, 71), [0, 63, 5] * 24)], dtype=torch.int64)[:70]
    buffers = [torch.zeros(72, 64 * 132, dtype=torch.uint8) for _ in range(2)]
    cpu_kernels.index_k_store(buffers[0], loc, q, scale, 64)
    dsa_index_k_cache._set_k_and_s_triton(buffers[1], loc, q, scale, 64)
    assert torch.equal(*buffers) and buffers[0].any()


def test_a_rows_value_names_its_prefix():
    hashes = kv_function.prefix_hashes([5, 6, 7])
    assert hashes[:2] == kv_function.prefix_hashes([5, 6])
    assert kv_function.prefix_hashes([5, 6, 8])[2] != hashes[2]
    rows = kv_function.ExpectedRows(fp8_pool=False).pool_rows(torch.tensor(hashes), 0)
    assert len({bytes(row.tolist()) for row in rows}) == 3


def test_the_workload_is_seeded_and_traffic_shaped():
    config = WorkloadConfig(requests=300, seed=3)
    specs = make_workload(config)
    assert specs == make_workload(config)
    assert specs != make_workload(WorkloadConfig(requests=300, seed=4))
    assert [s.arrival for s in specs] == sorted(s.arrival for s in specs)
    assert len({s.rid for s in specs}) == 300
    assert not any(a.rid != b.rid and b.rid.startswith(a.rid) for a in specs for b in specs)  # upstream's abort match
    lengths = sorted(len(s.input_ids) for s in specs)
    assert lengths[0] < 200 and lengths[-1] > 10 * 64  # a few tokens to many pages
    assert any(s.turn for s in specs) and any(s.ignore_eos for s in specs)
    assert {s.abort for s in specs} >= set(Abort)
    assert any(len(s.input_ids) % 64 == 0 for s in specs) and any(len(s.input_ids) % 64 for s in specs)


def _judged(prefill_overrides=None, decode_overrides=None):
    server, workload = ServerConfig(cp=1), WorkloadConfig(requests=3, seed=1)
    rids = [s.rid for s in make_workload(workload)]
    checks = {"rank": 0, "batches": 1, "tokens": 1, "reads_checked": 1, "index_k_rows_checked": 1}
    checks |= {"pool_rows_checked": 1, "mismatches": 0, "examples": [], "host_hit_tokens": 0}
    checks |= {"dense_slots_max": 1, "dense_slots_reserved": 1, "mode_host_syncs_max": 1, "upstream_host_reads": 0}
    prefill = {"role": "prefill", "rank": 0, "served": rids, "aborted": [], "abort_sent": {}, "unexpected": []}
    prefill |= {"memory_check_at_idle": "ok", "allocator_free_after_drain": 10, "allocator_total": 10}
    prefill |= {"request_rows_free": 4, "request_rows_total": 4, "checks": checks}
    decode = {"role": "decode", "rank": 0, "served": rids, "aborted": [], "unexpected": []}
    decode |= {"memory_check_at_idle": "ok", "allocator_free_after_drain": 10, "allocator_total": 10}
    decode |= {"checks": dict(checks, rank=-1), "received_without_decode_step": []}
    return report.scenario(
        server, workload, [prefill | (prefill_overrides or {}), decode | (decode_overrides or {})], 1.0
    )


def test_the_report_fails_a_scenario_for_each_kind_of_problem():
    assert _judged()["passed"]
    assert "tokens free after draining" in _judged({"allocator_free_after_drain": 9})["problems"][0]
    assert "leak" in _judged(decode_overrides={"memory_check_at_idle": "leak: x"})["problems"][0]
    assert "did not end" in _judged(decode_overrides={"served": []})["problems"][0]
    assert "crash" not in _judged()["problems"]
    crashed = _judged({"crash": "ValueError: x"})
    assert not crashed["passed"] and crashed["figures"]["crashes"] == 1
    unexpected = _judged({"unexpected": [{"request": "x", "finished": {"type": "abort"}}]})
    assert "ended unexpectedly" in unexpected["problems"][0]


@pytest.mark.parametrize("layout", ["rows, heads, dim", "rows, 1, heads, dim"])
def test_a_real_kernels_output_is_checked_against_the_mean_of_its_reads(layout):
    """The GPU soak's check of a real attention kernel (zero queries: each row's output is the mean of its reads),
    here on outputs made from the function, right and wrong, in each layout a route returns (``flashmla_kv``: one
    query per decode batch row, ``[rows, 1, heads, dim]``)."""
    from types import SimpleNamespace

    from sglang_cpkv.soak.model import Checks, StandInWorker

    hashes = torch.tensor([11, 12, 13], dtype=torch.int64)
    sel = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])  # row 2 reads nothing
    read = torch.tensor([0, 2, 1])  # the distinct hash each selected read is, in sel's row-major order
    rows = kv_function.latent_rows(hashes, 1)[0].float()
    mean = torch.stack([(rows[0] + rows[2]) / 2, rows[1], torch.zeros_like(rows[0])])
    output = mean[:, None, :].expand(3, 2, -1).to(torch.bfloat16)  # 2 heads, bf16 as a kernel writes it
    if layout == "rows, 1, heads, dim":
        output = output.unsqueeze(1)
    worker = SimpleNamespace(checks=Checks(rank=0))
    reqs, row_req, row_pos = [SimpleNamespace(rid="r0")], torch.zeros(3, dtype=torch.int64), torch.arange(3)
    StandInWorker._check_output(worker, output, sel, hashes, read, 1, reqs, row_req, row_pos)
    assert (worker.checks.kernel_outputs_checked, worker.checks.mismatches) == (2, 0)
    wrong = output.clone()
    wrong.view(3, 2, -1)[1, 1, 5] += 0.5
    StandInWorker._check_output(worker, wrong, sel, hashes, read, 1, reqs, row_req, row_pos)
    assert worker.checks.mismatches == 1 and worker.checks.examples[0]["kind"] == "kernel output"


def test_a_prefill_abort_that_reaches_the_decode_first_is_an_abort():
    """The prefill's mid-transfer abort fails the decode's transfer an iteration before the router's abort is read."""
    import queue
    from types import SimpleNamespace

    from sglang_cpkv.soak.decode import DecodeJob, RouterReceiver
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    workload = WorkloadConfig(requests=3, seed=5)
    rid = make_workload(workload)[0].rid
    failed = {"type": "abort", "message": f"Decode transfer failed for request {rid}"}
    scheduler = SimpleNamespace(recorder=SimpleNamespace(outputs=[]), last_batch=None, is_fully_idle=lambda: False)
    inbox = queue.Queue()
    receiver = RouterReceiver(scheduler, DecodeJob(ServerConfig(), workload, "", 0, ""), inbox)
    scheduler.recorder.outputs.append(SimpleNamespace(rids=[rid], finished_reasons=[failed]))
    receiver.recv_requests()  # the failed transfer is taken; the abort is not in the inbox yet
    assert receiver.unexpected() == [{"request": rid, "finished": failed}]
    inbox.put(("abort", rid))
    receiver.recv_requests()
    assert (receiver.aborted(), receiver.unexpected()) == ({rid}, [])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
