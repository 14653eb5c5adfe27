"""TEST-ONLY smoke of the GPU test environment: upstream's own DSA attention kit on the patched upstream.

Runs the sparse-prefill (EXTEND) cases of ``make_dsa_sparse_cases("dsa")`` from the kit shipped in the
pinned wheel (``sglang/test/kits/attention_unittest/attention_methods/dsa_attention.py``) through
``run_dsa_sparse_attention_case`` with each prefill backend a Hopper server of the mode can take and its real
kernel (``triton_sparse_mla``; ``flashmla_sparse``, ``flashmla_kv`` and ``flashmla_auto`` from the ``flash_mla``
library), on a bf16 pool and on the FP8 656-byte pool (``fp8_kv_cache=True``), with the CP shared-KV mode off (the
kit's server args do not enable it). Each case compares the backend's output with the kit's own reference.

Not a registered suite test (the kit tests of the mode belong in test/registered/); this checks that the
environment runs upstream's real code. Needs a CUDA device and the environment of scripts/gpu_env/install.sh:

    . /tmp/cpkv-site/cpkv-env.sh && python3 -m pytest scripts/gpu_env/dsa_kit_smoke.py -v

Under SGLANG_CPKV_REQUIRE_UPSTREAM=1 (that environment) nothing here skips: a skip is a failure.
"""

import importlib.util
import sys

import pytest
import torch

from sglang_cpkv.testing.upstream_env import kit_testcase, skip_or_fail
from sglang_cpkv.upstream_import import install_torchvision_stub

install_torchvision_stub()
try:
    from sglang.test.kits.attention_unittest.attention_methods import dsa_attention as kit

    CASES = [c for c in kit.make_dsa_sparse_cases("dsa") if c.forward_mode.is_extend_without_speculative()]
    IMPORT_ERROR = None
except ImportError as exc:  # reported by test_kit_imports (a failure in the GPU test environment)
    kit, CASES, IMPORT_ERROR = None, [], exc


def test_kit_imports_and_has_extend_cases():
    if IMPORT_ERROR is not None:
        skip_or_fail(f"upstream's DSA attention kit does not import: {IMPORT_ERROR}")
    assert len(CASES) >= 3, [c.name for c in CASES]


@pytest.mark.parametrize("backend", ["triton_sparse_mla", "flashmla_sparse", "flashmla_kv", "flashmla_auto"])
@pytest.mark.parametrize("fp8_kv_cache", [False, True], ids=["bf16_pool", "fp8_pool"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sparse_prefill(case, fp8_kv_cache, backend):
    if not torch.cuda.is_available():
        skip_or_fail("needs a CUDA device")
    if backend != "triton_sparse_mla" and importlib.util.find_spec("flash_mla") is None:
        skip_or_fail(f"{backend} needs the flash_mla library (sgl-flash-mla), not installed here")
    kit.run_dsa_sparse_attention_case(kit_testcase(), case, dsa_prefill_backend=backend, fp8_kv_cache=fp8_kv_cache)
    from sglang_cpkv.hooks import settings

    assert not settings.enabled(), "the CP shared-KV mode was on: this smoke runs upstream's path with it off"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-rs"]))
