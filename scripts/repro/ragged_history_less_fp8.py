"""Standalone repro of docs/upstream-findings.md item 3, with upstream sglang's own DSA attention test kit only.

On the RAGGED top-k route (an FP8 656-byte KV cache, ``flashmla_sparse`` or ``triton_sparse_mla`` prefill),
``DeepseekSparseAttnBackend.forward_extend`` decides ``_has_prefix`` for the whole batch. A batch of two requests,
the first over a cached prefix, the second without history: the keys the kernel is handed for the second request
are compared with its chunk's bf16 rows ``cat(k_nope, k_rope)``, the keys it is handed alone or in any batch without
a cached prefix. Upstream 0.5.23 prints "other keys" (FP8-rounded: quantized into the cache, dequantized); with the
fix it prints "same keys". Needs a CUDA GPU (the kit's device; the kernels and the dequantization are CUDA/Triton).

    python scripts/repro/ragged_history_less_fp8.py [--backend flashmla_sparse | --backend triton_sparse_mla --heads 32]

Exit status: 0 when the keys are the same, 1 when they differ.
"""

from __future__ import annotations

import argparse
import os
import unittest

import torch

# The sparse route, as a server takes it past the dense-MHA threshold (2048 keys by default), for short requests.
os.environ.setdefault("SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD", "0")


def keys_of_the_history_less_request(
    backend_name: str, prefix: int, extend: int, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.dsa_attention import (
        DSAAttentionCase,
        build_dsa_sparse_attention_fixture,
        run_dsa_sparse_fixture_eager,
    )

    case = DSAAttentionCase(
        name="ragged_history_less_fp8",
        backend="dsa",
        forward_mode=ForwardMode.EXTEND,
        num_heads=heads,
        num_kv_heads=1,
        page_size=64,
        prefix_lens=(prefix, 0),
        extend_lens=(extend, extend),
    )
    testcase = unittest.TestCase()
    fixture = build_dsa_sparse_attention_fixture(testcase, case, dsa_prefill_backend=backend_name, fp8_kv_cache=True)
    handed = {}
    kernel_name = "_forward_triton_sparse_mla" if backend_name == "triton_sparse_mla" else "_forward_flashmla_sparse"
    kernel = getattr(fixture.backend, kernel_name)

    def record(*args, **kwargs):
        handed["kv"] = kwargs["kv_cache"].detach().clone()
        return kernel(*args, **kwargs)

    setattr(fixture.backend, kernel_name, record)
    run_dsa_sparse_fixture_eager(fixture, testcase)
    k_nope, k_rope = fixture.actual_module.project_k(fixture.input_hidden)
    chunk = torch.cat([k_nope.reshape(k_nope.shape[0], -1), k_rope.reshape(k_rope.shape[0], -1)], dim=-1)
    kv = handed["kv"].reshape(-1, chunk.shape[-1])
    # The second request is the last one of the batch and has no history: its keys are the last `extend` rows of the
    # flattened KV (prefix + extend rows of the first request come before) and of the chunk.
    return kv[-extend:], chunk[-extend:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("flashmla_sparse", "triton_sparse_mla"), default="flashmla_sparse")
    parser.add_argument("--prefix", type=int, default=128, help="the first request's cached prefix")
    parser.add_argument("--extend", type=int, default=64)
    parser.add_argument("--heads", type=int, default=64, help="query heads (triton_sparse_mla takes at most 32)")
    args = parser.parse_args()
    handed, bf16 = keys_of_the_history_less_request(args.backend, args.prefix, args.extend, args.heads)
    if torch.equal(handed, bf16):
        print(f"{args.backend}: same keys: the history-less request reads its chunk's bf16 rows, as alone")
        return 0
    diff = (handed.float() - bf16.float()).abs().max().item()
    print(
        f"{args.backend}: other keys: beside a cached prefix the history-less request reads FP8-rounded keys "
        f"(max abs difference {diff:.4g} from its bf16 rows, which it reads alone)"
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
