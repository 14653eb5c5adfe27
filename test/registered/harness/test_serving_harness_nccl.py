"""The serving-path harness on two GPUs: cp=1 on GPU 0 and cp=2 over NCCL (one process per GPU).

Upstream's DSA attention kit through the patched backend (:mod:`sglang_cpkv.harness.serving`), every route
(``flashmla_*`` and ``triton_sparse_mla`` run for real), bs 2/4/8, radix hits, a chunked continuation and the dense
layout's sharing patterns: each request equal to its bs=1 run and to the mode-off run, the ranks' dense views
byte-equal. Skips with the reason when fewer than two GPUs are visible.
"""

import sys

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cuda_ci

register_cuda_ci(est_time=480, stage="cpkv", runner_config="2-gpu")


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 GPUs for cp=2 over NCCL, {torch.cuda.device_count()} visible"
)
def test_nccl_cp2_serving_stack_every_route():
    from sglang_cpkv.harness import serving
    from sglang_cpkv.testing.upstream_env import skip_or_fail

    try:
        import sglang.test.kits.attention_unittest.attention_methods.dsa_attention  # noqa: F401
    except ImportError as exc:
        skip_or_fail(f"needs the pinned upstream sglang: {exc}")
    report = serving.run_serving_harness(
        [1, 2], [2, 4, 8], list(serving.SCENARIO_NAMES), list(serving.ROUTES), "cuda", log=print
    )
    assert report["failures"] == [], report["failures"]
    assert report["summary"]["by_kind"]["ranks"]["total"] == len(serving.ROUTES) * len(serving.SCENARIO_NAMES) * 3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
