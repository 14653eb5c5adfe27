"""The host-path benchmarks still run against the code they measure (a benchmark nobody runs rots silently).

Each benchmark that can run on the CPU runs here once with the smallest arguments, through its own ``main``, and
writes its JSON: every row it reports is there, with a measured time. The figures themselves are not judged (a 2-core
CI machine's timings mean nothing); what fails is a benchmark that no longer runs on the current API.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="cpkv-cpu")

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmark"


def _main(name: str):
    spec = importlib.util.spec_from_file_location(f"cpkv_benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_bench_host_layout_runs(tmp_path):
    out = tmp_path / "layout.json"
    args = ["--requests", "1,3", "--history", "256", "--extend", "64", "--cp", "1,2", "--reps", "2"]
    assert _main("bench_host_layout")([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["cp"], r["sharing"], r["requests"]) for r in rows} == {
        (cp, sharing, n) for cp in (1, 2) for sharing in ("distinct", "shared") for n in (1, 3)
    }
    assert all(r["entries"] > 0 and r["numpy_us"] > 0 and r["compiled_us"] > 0 for r in rows)


@pytest.mark.parametrize("name", ["plan_host_phases", "bench_plan_host"])
def test_plan_host_benchmarks_run_on_the_cpu(tmp_path, name):
    out = tmp_path / f"{name}.json"
    args = ["--requests", "2", "--history", "128", "--extend", "64", "--reps", "2", "--device", "cpu"]
    if name == "bench_plan_host":
        args += ["--backend", "triton_sparse_mla", "--no-fp8"]
    assert _main(name)([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    if name == "plan_host_phases":
        mode_on = result["results"]["2 requests, mode on, synchronous"]
        assert mode_on["host_ms"] > 0 and mode_on["phases_ms"]["hook / build_plan"] > 0
        assert "build_plan / _host_layout (compiled where built)" in mode_on["phases_ms"]
    else:
        assert {r["config"] for r in result["rows"]} == {"mode off", "mode on, layer-ahead", "mode on, synchronous"}
        assert all(r["host_ms"] > 0 for r in result["rows"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
