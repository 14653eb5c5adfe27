"""The CP correctness harness on two GPUs: cp=1 on GPU 0 and cp=2 over NCCL (one process per GPU).

bs 2/4/8, every scenario: each batch request byte-equal to its bs=1 golden (outputs and dense KV
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

register_cuda_ci(est_time=120, stage="cpkv", runner_config="2-gpu")


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
