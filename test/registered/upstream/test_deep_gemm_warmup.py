"""DeepGEMM warmup M grid under DSA prefill CP, through the patched 0.5.23 ``compile_utils``.

Each case resolves a real ``ServerArgs`` for a local GLM-5 (``GlmMoeDsaForCausalLM``) config on CPU,
publishes it, runs upstream's ``update_deep_gemm_config`` and then upstream's
``_maybe_compile_deep_gemm_one_type_all`` for one shape of every kernel type. A stand-in replaces
only ``_compile_deep_gemm_one_type_all`` (the loop that drives deep_gemm's JIT over the M list) and
records the Ms it is asked to compile. Expected: grouped MoE types get upstream's full list; dense
types get ``1..max(ceil(m_max / cp), 2048)`` when prefill CP splits every token-heavy batch and the
FFNs stay on rank rows; cp=1, a gathered FFN, zigzag at bs > 1 or a full-M draft extend change
nothing. The reasoning behind each case is in ``sglang_cpkv.hooks.deep_gemm_warmup`` and the manifest.
On unpatched upstream the dense-prefix cases fail (every shape gets the full list).
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

from sglang_cpkv.upstream_import import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.layers.deep_gemm_wrapper import compile_utils  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

GLM5_DIR = Path(__file__).parent / "fixtures" / "glm5_dsa"
KernelType = compile_utils.DeepGemmKernelType
# (kernel type, n, k, num_groups): GLM-5 per-rank shapes at tp 8 / ep 8 (32 local experts).
SHAPES = (
    (KernelType.GROUPED_GEMM_NT_F8F8BF16_CONTIG, 4096, 6144, 32),
    (KernelType.GROUPED_GEMM_NT_F8F8BF16_MASKED, 6144, 2048, 32),
    (KernelType.GROUPED_GEMM_NT_BF16_CONTIG, 4096, 6144, 32),
    (KernelType.GROUPED_GEMM_NT_BF16_MASKED, 6144, 2048, 32),
    (KernelType.GEMM_NT_F8F8BF16, 2624, 6144, 1),
    (KernelType.GEMM_NT_F8F8BF16_BLOCK32, 6144, 16384, 1),
    (KernelType.GEMM_NT_BF16BF16F32, 160, 6144, 1),
)
BASE = dict(model_path=str(GLM5_DIR), skip_tokenizer_init=True, device="cuda", tp_size=8, chunked_prefill_size=65536)
SPLIT_FFN_ON_RANK_ROWS = dict(
    enable_prefill_cp=True, cp_strategy="interleave", moe_dense_tp_size=1, moe_a2a_backend="deepep"
)


def compiled_m_lists(monkeypatch, tmp_path, env=None, **server):
    """Resolve + publish the server args, configure upstream's warmup, return {kernel type: Ms asked}."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    args = ServerArgs(**BASE, **server)
    args.resolve_once()
    runtime_context.get_context().set_server_args(args)
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_utils, "_ENABLE_JIT_DEEPGEMM_PRECOMPILE", True)
    monkeypatch.setattr(compile_utils, "_IN_PRECOMPILE_STAGE", True)
    monkeypatch.setattr(compile_utils, "_INITIALIZATION_DICT", {})
    asked = {}

    def stand_in(kernel_type, n, k, num_groups, m_list):  # replaces the deep_gemm JIT loop only
        asked[kernel_type] = list(m_list)

    monkeypatch.setattr(compile_utils, "_compile_deep_gemm_one_type_all", stand_in)
    compile_utils.update_deep_gemm_config(gpu_id=0)  # base_gpu_id 0: this is the first rank on the node
    for kernel_type, n, k, num_groups in SHAPES:
        compile_utils._maybe_compile_deep_gemm_one_type_all(kernel_type, n, k, num_groups)
    return asked, list(compile_utils._BUILTIN_M_LIST)


def expected_dense(full, cp, floor_extra=0):
    top = max(math.ceil(max(full) / cp), 2048, floor_extra)
    return [m for m in full if m <= top]


def test_prefill_cp_dense_prefix_grouped_full(monkeypatch, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_cpkv.hooks.deep_gemm_warmup"):
        asked, full = compiled_m_lists(monkeypatch, tmp_path, disaggregation_mode="prefill", **SPLIT_FFN_ON_RANK_ROWS)
    assert len(full) == 2 * 65536  # upstream: m_max = 2 x chunked prefill size
    for kernel_type, _, _, _num_groups in SHAPES:
        if kernel_type.name.startswith("GROUPED_"):
            assert asked[kernel_type] == full, kernel_type
        else:
            assert asked[kernel_type] == expected_dense(full, cp=8), (kernel_type, len(asked[kernel_type]))
    assert len(asked[KernelType.GEMM_NT_F8F8BF16]) == 16384
    assert "GEMM_NT_F8F8BF16> N=2624 K=6144 num_groups=1: 16384 of 131072 Ms" in caplog.text
    assert "GROUPED_GEMM_NT_F8F8BF16_CONTIG> N=4096 K=6144 num_groups=32: 131072 of 131072 Ms" in caplog.text


def test_zigzag_at_batch_size_one_shrinks(monkeypatch, tmp_path):
    # zigzag forces moe_dense_tp_size=1 and deepep itself; bs=1 rules out its un-split fallback
    asked, full = compiled_m_lists(
        monkeypatch,
        tmp_path,
        disaggregation_mode="prefill",
        enable_prefill_cp=True,
        cp_strategy="zigzag",
        max_running_requests=1,
    )
    assert asked[KernelType.GEMM_NT_F8F8BF16] == expected_dense(full, cp=8)
    assert asked[KernelType.GROUPED_GEMM_NT_F8F8BF16_CONTIG] == full


def test_prefill_server_with_target_layout_draft_shrinks(monkeypatch, tmp_path):
    # EAGLE/NextN's prefill-time draft extend is an EXTEND batch under the target's CP; a P/D prefill
    # server never runs the decode-time draft extend
    asked, full = compiled_m_lists(
        monkeypatch,
        tmp_path,
        disaggregation_mode="prefill",
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        **SPLIT_FFN_ON_RANK_ROWS,
    )
    assert asked[KernelType.GEMM_NT_F8F8BF16] == expected_dense(full, cp=8)


def test_decoding_server_with_draft_under_cp_env(monkeypatch, tmp_path):
    eagle = dict(
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        max_running_requests=1024,
    )
    asked, full = compiled_m_lists(monkeypatch, tmp_path, **SPLIT_FFN_ON_RANK_ROWS, **eagle)
    assert asked[KernelType.GEMM_NT_F8F8BF16] == full  # DRAFT_EXTEND_V2 is never CP in 0.5.23
    asked, full = compiled_m_lists(
        monkeypatch, tmp_path, env={"SGLANG_CP_DRAFT_SHARED_KV": "1"}, **SPLIT_FFN_ON_RANK_ROWS, **eagle
    )
    # un-split verify batches: 1024 requests x 4 draft tokens rows
    assert asked[KernelType.GEMM_NT_F8F8BF16] == expected_dense(full, cp=8, floor_extra=4096)


@pytest.mark.parametrize(
    "server",
    [
        pytest.param(dict(disaggregation_mode="prefill"), id="cp1"),
        pytest.param(
            dict(disaggregation_mode="prefill", enable_prefill_cp=True, cp_strategy="interleave"),
            id="interleave-gathered-ffn",
        ),
        pytest.param(
            dict(disaggregation_mode="prefill", enable_prefill_cp=True, cp_strategy="zigzag"), id="zigzag-bs-gt-1"
        ),
        pytest.param(
            dict(
                disaggregation_mode="prefill",
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=str(GLM5_DIR),
                speculative_num_steps=3,
                speculative_eagle_topk=1,
                speculative_num_draft_tokens=4,
                **SPLIT_FFN_ON_RANK_ROWS,
            ),
            id="single-group-draft-full-m",
        ),
        pytest.param(dict(max_running_requests=None, **SPLIT_FFN_ON_RANK_ROWS), id="decode-batches-unbounded"),
    ],
)
def test_full_list_everywhere(monkeypatch, tmp_path, server):
    asked, full = compiled_m_lists(monkeypatch, tmp_path, **server)
    assert all(m_list == full for m_list in asked.values()), {t.name: len(v) for t, v in asked.items()}
    assert len(asked) == len(SHAPES)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
