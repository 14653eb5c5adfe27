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
        assert mode_on["phases_ms"]["build_plan / _BatchLayout (the layout in numpy)"] > 0
    else:
        assert {r["config"] for r in result["rows"]} == {"mode off", "mode on, layer-ahead", "mode on, synchronous"}
        assert all(r["host_ms"] > 0 for r in result["rows"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
