"""The serving-path harness on one GPU: upstream's DSA attention kit through the patched backend, with every route's
real kernel, at cp 1 and at cp 2 over gloo (two ranks on the one GPU).

Every route of :data:`~sglang_cpkv.harness.serving.ROUTES` (``triton_sparse_mla`` PAGED bf16 and RAGGED FP8;
``flashmla_kv`` FP8, ``flashmla_sparse`` bf16 with IndexShare layers and FP8 RAGGED, ``flashmla_auto`` FP8, from the
``flash_mla`` library), bs 2, 4 and 8, every scenario: the kernel reads the same KV bytes and gives the same output
with the mode on as off, and each request of the batch reads and gets what it does alone (on FlashMLA's split-KV
kernel, whose rounding follows the batch: reads what it does alone, and alone gets upstream's own output). At cp 2 each rank's pool
holds its owned pages in device memory, the history all-gather lands in the dense views through gloo (NCCL refuses
two ranks on one device), and the ranks' dense views are byte-equal.
"""

import sys

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cuda_ci
from sglang_cpkv.testing.upstream_env import skip_or_fail

register_cuda_ci(est_time=240, stage="cpkv", runner_config="1-gpu")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
try:
    import sglang.test.kits.attention_unittest.attention_methods.dsa_attention  # noqa: F401

    from sglang_cpkv.harness import serving
    from sglang_cpkv.testing.dsa_kit import missing_kernel_library
except ImportError as exc:
    skip_or_fail(f"needs the pinned upstream sglang: {exc}")
MISSING = sorted({m for r in serving.ROUTES.values() if (m := missing_kernel_library(r))})
if MISSING:
    skip_or_fail(f"needs the kernel libraries {MISSING} (sgl-flash-mla: scripts/gpu_env/install.sh carries it)")


# FlashMLA's split-KV decode kernel (module docstring of harness/serving.py): flashmla_kv, and flashmla_auto on an
# FP8 pool on Hopper (upstream picks flashmla_kv there).
SPLIT_KV_ROUTES = {"flashmla_kv-fp8-paged", "flashmla_auto-fp8"}


def _assert_report(report, cp, bs_list):
    failures = [
        f"{c['route']} {c['scenario']} cp {c['cp']} bs {c['bs']} {c['check']}: {c['problems']}"
        for c in report["failures"]
    ]
    assert failures == [], "\n".join(failures)
    per_route = {}
    for c in report["checks"]:
        per_route.setdefault(c["route"], []).append(c["check"])
    assert per_route.keys() == serving.ROUTES.keys()
    for route, kinds in per_route.items():
        # mode_off (where upstream serves the batch), bs1, alone_off (split-KV), ranks (cp > 1)
        kinds_per_scenario = 1 + (route in SPLIT_KV_ROUTES) + (cp > 1)
        expected = len(serving.SCENARIO_NAMES) * kinds_per_scenario + len(serving.SCENARIO_NAMES)
        expected -= len(serving.UPSTREAM_CANNOT_SERVE)
        assert len(kinds) == expected * len(bs_list), (route, sorted(kinds))
    assert all(c["rows_with_kernel_output"] == c["rows"] for c in report["checks"])  # every real kernel ran


def test_cp1_every_route_bs_2_4_8():
    report = serving.run_serving_harness(
        [1], [2, 4, 8], list(serving.SCENARIO_NAMES), list(serving.ROUTES), "cuda", log=print
    )
    _assert_report(report, 1, [2, 4, 8])


def test_cp2_over_gloo_on_one_gpu_every_route_bs_2_4():
    report = serving.run_serving_harness(
        [2], [2, 4], list(serving.SCENARIO_NAMES), list(serving.ROUTES), "cuda", log=print, dist_backend="gloo"
    )
    _assert_report(report, 2, [2, 4])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
