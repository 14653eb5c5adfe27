"""How many DeepGEMM kernels the warmup compiles for GLM-5.1 under DSA prefill CP, upstream vs ours.

Counts (shape, M) pairs the warmup asks DeepGEMM to JIT on one P/D prefill rank: upstream 0.5.23
compiles ``1..m_max`` for every shape (m_max = min(2 x chunked prefill size, 128K) = 131072 at
``--chunked-prefill-size 65536``); the patch ``core/split-deep-gemm-warmup-m-grid-under-cp.patch``
keeps that for the grouped MoE shapes and, when ``sglang_cpkv.hooks.deep_gemm_warmup.plan_dense_warmup``
says every non-grouped GEMM runs at per-rank M, compiles ``1..max(ceil(m_max / cp), 2048)`` for
the dense ones. Contiguous grouped shapes compile only Ms that are multiples of DeepGEMM's
contiguous-layout alignment (upstream filters with ``get_mk_alignment_for_contiguous_layout()``).

The shape set is GLM-5.1-FP8 (``glm_moe_dsa``: hidden 6144, 64 heads, q_lora 2048, kv_lora 512,
qk nope/rope 192/64, v 256, indexer 32 heads x 128, dense FFN 12288, 256 experts top-8 with
moe_intermediate 2048 and 1 shared expert) at tp 8 = attn CP 8 (attention TP 1), EP 8 (32 local
experts), ``--moe-dense-tp-size 1``: the block-FP8 linears DeepGEMM's dense FP8 GEMM runs and the
MoE's contiguous grouped GEMMs (DeepEP normal mode; the masked ones run on decode servers only).
Pure arithmetic over the policy: no GPU, no sglang import.

    python benchmark/deep_gemm_warmup_kernel_count.py [--cp 8] [--chunked-prefill-size 65536] [--mtp]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sglang_cpkv.hooks.deep_gemm_warmup import plan_dense_warmup, warmup_m_list

HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 6144, 64, 2048, 512, 192, 64, 256
INDEX_HEADS, INDEX_DIM, DENSE_FFN, MOE_FFN, EXPERTS = 32, 128, 12288, 2048, 256


def glm51_shapes(*, tp: int, attn_tp: int, ep: int, mtp: bool) -> list:
    """(name, kernel type, n, k, num_groups) of one prefill rank; dense FFN and shared expert unsharded."""
    dense = "GEMM_NT_F8F8BF16"
    shapes = [
        ("attn fused_qkv_a_proj_with_mqa", dense, Q_LORA + KV_LORA + ROPE, HIDDEN, 1),
        ("attn q_b_proj", dense, HEADS // attn_tp * (NOPE + ROPE), Q_LORA, 1),
        ("attn o_proj", dense, HIDDEN, HEADS // attn_tp * V_HEAD, 1),
        ("indexer wq_b", dense, INDEX_HEADS * INDEX_DIM, Q_LORA, 1),
        ("dense MLP gate_up (3 layers)", dense, 2 * DENSE_FFN, HIDDEN, 1),
        ("dense MLP down", dense, HIDDEN, DENSE_FFN, 1),
        ("shared expert gate_up", dense, 2 * MOE_FFN, HIDDEN, 1),
        ("shared expert down", dense, HIDDEN, MOE_FFN, 1),
        ("MoE gate_up (contiguous)", "GROUPED_GEMM_NT_F8F8BF16_CONTIG", 2 * MOE_FFN, HIDDEN, EXPERTS // ep),
        ("MoE down (contiguous)", "GROUPED_GEMM_NT_F8F8BF16_CONTIG", HIDDEN, MOE_FFN, EXPERTS // ep),
    ]
    if mtp:
        shapes.append(("NextN eh_proj", dense, HIDDEN, 2 * HIDDEN, 1))  # other NextN shapes repeat the target's
    return shapes


def kernel_count(m_list: list, kernel_type: str, contig_alignment: int) -> int:
    if kernel_type.endswith("_CONTIG"):
        return sum(1 for m in m_list if m % contig_alignment == 0)
    return len(m_list)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=8, help="attention CP size (= tp, attention TP 1)")
    parser.add_argument("--chunked-prefill-size", type=int, default=65536)
    parser.add_argument("--contig-alignment", type=int, default=128, help="DeepGEMM contiguous-layout M alignment")
    parser.add_argument(
        "--mtp", action="store_true", help="EAGLE/NextN draft (prefill-time draft extend runs under CP)"
    )
    args = parser.parse_args(argv)
    m_max = min(2 * args.chunked_prefill_size, 128 * 1024) if args.chunked_prefill_size > 8192 else 16 * 1024
    full = list(range(1, m_max + 1))
    shapes = glm51_shapes(tp=args.cp, attn_tp=1, ep=args.cp, mtp=args.mtp)
    spec = dict(
        speculative_algorithm="EAGLE" if args.mtp else None, speculative_num_draft_tokens=4 if args.mtp else None
    )
    configs = {
        "interleave --moe-dense-tp-size 1 --moe-a2a-backend deepep": dict(
            cp_strategy="interleave", moe_dense_tp_size=1, moe_a2a_backend="deepep", max_running_requests=None
        ),
        "zigzag --max-running-requests 1 (zigzag forces dense tp 1 + deepep)": dict(
            cp_strategy="zigzag", moe_dense_tp_size=1, moe_a2a_backend="deepep", max_running_requests=1
        ),
        "interleave, defaults (gathered FFN)": dict(
            cp_strategy="interleave", moe_dense_tp_size=None, moe_a2a_backend="none", max_running_requests=None
        ),
    }
    print(
        f"GLM-5.1-FP8, P/D prefill rank, cp={args.cp}, chunked prefill {args.chunked_prefill_size} -> m_max {m_max}, "
        f"{len(shapes)} shapes{' (with MTP)' if args.mtp else ''}"
    )
    for label, config in configs.items():
        plan = plan_dense_warmup(
            enable_prefill_cp=True,
            attn_cp_size=args.cp,
            disaggregation_mode="prefill",
            draft_extend_under_cp=False,
            **spec,
            **config,
        )
        before = after = 0
        rows = []
        for name, kernel_type, n, k, groups in shapes:
            upstream = kernel_count(full, kernel_type, args.contig_alignment)
            ours = kernel_count(warmup_m_list(plan, kernel_type, groups, full), kernel_type, args.contig_alignment)
            before, after = before + upstream, after + ours
            rows.append(
                f"    {name:32s} {kernel_type:32s} N={n:<6d} K={k:<6d} G={groups:<3d} {upstream:>7d} -> {ours:>7d}"
            )
        factor = before / after
        print(
            f"\n{label}: {before:,} -> {after:,} kernels ({factor:.2f}x fewer, -{100 * (1 - after / before):.1f}%)"
            f"\n  plan: divide by {plan.cp_divisor} ({plan.reason})"
        )
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
