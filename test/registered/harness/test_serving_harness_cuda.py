"""The serving-path harness on one GPU: upstream's DSA attention kit through the patched backend at cp 1.

Every route (``triton_sparse_mla`` PAGED bf16 and RAGGED FP8 with the real kernel; ``flashmla_kv`` FP8 and
``flashmla_sparse`` bf16 with IndexShare layers captured: ``flash_mla`` is not installed there), bs 2, 4 and 8,
both scenarios: the kernel reads the same KV bytes (and ``triton_sparse_mla`` gives the same output) with the
mode on as off, and each request of the batch reads and gets what it does alone.
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
except ImportError as exc:
    skip_or_fail(f"needs the pinned upstream sglang: {exc}")


def test_cp1_every_route_bs_2_4_8():
    report = serving.run_serving_harness(
        [1], [2, 4, 8], list(serving.SCENARIO_NAMES), list(serving.ROUTES), "cuda", log=print
    )
    assert report["failures"] == [], report["failures"]
    assert report["summary"]["checks"] == len(serving.ROUTES) * len(serving.SCENARIO_NAMES) * 3 * 2
    triton = [c for c in report["checks"] if c["route"].startswith("triton")]
    assert triton and all(c["rows_with_kernel_output"] == c["rows"] for c in triton)  # the real kernel ran


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
