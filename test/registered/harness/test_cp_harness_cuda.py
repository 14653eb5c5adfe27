"""The CP correctness harnesses on two GPUs: cp=1 on GPU 0 and cp=2 over NCCL (one process per GPU).

Serving stack (:mod:`sglang_cpkv.harness.serving`): upstream's DSA attention kit through the patched backend,
every route (``triton_sparse_mla`` runs for real), bs 2/4/8, radix hits and a chunked continuation: each request
equal to its bs=1 run and to the mode-off run, the ranks' dense views byte-equal.

Toy stack: bs 2/4/8, every scenario: each batch request byte-equal to its bs=1 golden (outputs and dense KV
views) on every rank, goldens equal across cp, and the 1-D value-keyed negative control
contaminating the collision class only. Skips with the reason when fewer than two GPUs are visible.
The ops run on whatever backend the dispatcher picks (``SGLANG_CPKV_OPS_BACKEND``, default auto).
"""

import sys

import pytest
import torch

from sglang_cpkv.harness import run_harness
from sglang_cpkv.harness.scenarios import SCENARIO_NAMES
from sglang_cpkv.testing.batches import COLLISION
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


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 GPUs for cp=2 over NCCL, {torch.cuda.device_count()} visible"
)
def test_nccl_cp2_batches_byte_equal_to_bs1_and_negative_control_detects():
    report = run_harness([1, 2], [2, 4, 8], list(SCENARIO_NAMES), "cuda", None, log=print)
    assert report["failures"] == [], report["failures"]
    batches = [c for c in report["checks"] if c["check"] == "batch"]
    assert len(batches) == len(SCENARIO_NAMES) * 3 * 3  # (cp=1 rank 0, cp=2 ranks 0 and 1) x bs
    controls = [c for c in report["checks"] if c["check"] == "negative_control"]
    assert all(c["requests_contaminated"] for c in controls if c["state_class"] == COLLISION)
    assert sum(c["state_class"] == COLLISION for c in controls) == 6


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
