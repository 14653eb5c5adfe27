"""The DeepGEMM warm-up M grid under DSA prefill CP (hooks in upstream 0.5.23's ``compile_utils.py``).

Called from ``patches/core/split-deep-gemm-warmup-m-grid-under-cp.patch``: :func:`configure_from_runtime` plans from
the published server args, :func:`shape_m_list` gives each shape its M list. Grouped MoE GEMMs keep upstream's full
list (the all-to-all brings every routed token to its expert whatever the split); non-grouped shapes compile
``1..max(ceil(m_max / cp), 2048)`` (and the un-split decode/verify rows) only when every non-grouped GEMM of the
server runs at per-rank M: every token-heavy batch split by CP, the FFN on the rank's rows, no draft extend at full
M, small non-CP batches. Anything else keeps the full list; each shape logs its count and why. The reading of 0.5.23
behind each condition: the patch's ``why`` in ``patches/manifest.json`` (``docs/design/cp-shared-kv.md`` section 10).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from sglang_cpkv.hooks.settings import DRAFT_SHARED_KV_ENV, draft_extends_under_cp

logger = logging.getLogger(__name__)

DENSE_M_FLOOR = 2048  # the smallest top of the shrunk list, whatever m_max / cp gives
# Drafts that run their prefill-time extend on their own TP group without CP (0.5.23
# legacy_draft_parallel_spec: EAGLE3, DFLASH and non-MoE DSpark; DSpark counted here whatever its MoE).
FULL_M_DRAFT_ALGORITHMS = frozenset({"EAGLE3", "DFLASH", "DSPARK"})
NO_DRAFT_ALGORITHMS = frozenset({"", "NONE", "NGRAM"})  # NGRAM has no draft model


@dataclasses.dataclass(frozen=True)
class DenseWarmupPlan:
    """How the non-grouped shapes' M list is cut: ``cp_divisor == 1`` keeps upstream's list."""

    cp_divisor: int
    reason: str
    non_cp_max_m: int = 0  # rows of the largest un-split batch (decode / verify) the shrunk list must keep

    def dense_m_cap(self, m_max: int) -> int:
        return max(math.ceil(m_max / self.cp_divisor), DENSE_M_FLOOR, self.non_cp_max_m)


FULL_LIST = DenseWarmupPlan(1, "not configured")


def plan_dense_warmup(
    *,
    enable_prefill_cp: bool,
    attn_cp_size: int,
    cp_strategy: str | None,
    moe_dense_tp_size: int | None,
    moe_a2a_backend: str | None,
    disaggregation_mode: str | None,
    max_running_requests: int | None,
    speculative_algorithm: str | None,
    speculative_num_draft_tokens: int | None,
    draft_extend_under_cp: bool,
) -> DenseWarmupPlan:
    """Decide, from resolved server settings, whether every non-grouped GEMM runs at per-rank M."""
    if not enable_prefill_cp or attn_cp_size <= 1:
        return DenseWarmupPlan(1, "prefill CP off")
    if cp_strategy not in ("interleave", "zigzag"):
        return DenseWarmupPlan(1, f"unknown CP strategy {cp_strategy!r}")
    if cp_strategy == "zigzag" and max_running_requests != 1:
        return DenseWarmupPlan(
            1,
            "zigzag runs a batch un-split at full M when any request extends fewer than "
            "2*cp tokens; only --max-running-requests 1 rules that out",
        )
    if moe_dense_tp_size != 1:
        return DenseWarmupPlan(1, "dense FFN GEMMs run on tokens gathered over attention CP (moe_dense_tp_size != 1)")
    if moe_a2a_backend in (None, "none"):
        return DenseWarmupPlan(
            1, "MoE input and shared-expert GEMMs run on tokens gathered over attention CP (no MoE all-to-all backend)"
        )
    decodes = disaggregation_mode != "prefill"
    algorithm = (speculative_algorithm or "").upper()
    if algorithm in FULL_M_DRAFT_ALGORITHMS:
        return DenseWarmupPlan(1, f"the {algorithm} draft runs its prefill extend on its own group without CP (full M)")
    if algorithm not in NO_DRAFT_ALGORITHMS and decodes and not draft_extend_under_cp:
        return DenseWarmupPlan(
            1,
            f"the decode-time draft extend (DRAFT_EXTEND_V2) runs without CP (full M); "
            f"{DRAFT_SHARED_KV_ENV}=1 declares it runs under CP",
        )
    non_cp_max_m = 0
    if decodes:
        if max_running_requests is None:
            return DenseWarmupPlan(
                1, "this server decodes and --max-running-requests is unset: un-split decode batches have no bound"
            )
        non_cp_max_m = max_running_requests * max(1, speculative_num_draft_tokens or 1)
    return DenseWarmupPlan(
        attn_cp_size,
        f"{cp_strategy} prefill CP over {attn_cp_size} ranks splits every "
        "token-heavy batch and the FFNs stay on rank rows",
        non_cp_max_m,
    )


def is_grouped_kernel_type(kernel_type_name: str) -> bool:
    """DeepGemmKernelType names: GROUPED_GEMM_NT_* are the MoE grouped GEMMs (contiguous and masked)."""
    return kernel_type_name.startswith("GROUPED_")


def warmup_m_list(plan: DenseWarmupPlan, kernel_type_name: str, num_groups: int, full_m_list: Sequence[int]) -> list:
    """The Ms to compile for one shape: upstream's full list, or its per-rank prefix for dense shapes."""
    full = list(full_m_list)
    if plan.cp_divisor <= 1 or is_grouped_kernel_type(kernel_type_name) or num_groups != 1 or not full:
        return full
    cap = plan.dense_m_cap(max(full))
    return [m for m in full if m <= cap]


_plan: DenseWarmupPlan = FULL_LIST


def configure(plan: DenseWarmupPlan) -> None:
    global _plan
    _plan = plan
    logger.info("DeepGEMM warmup M grid: non-grouped shapes divide m_max by %d (%s)", plan.cp_divisor, plan.reason)


def configure_from_runtime() -> DenseWarmupPlan:
    """Hook for ``update_deep_gemm_config``: read the published server args (lazy sglang import)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.runtime_context import get_context

    server_args = get_context().server_args

    def value(name):
        return resolution_result(server_args, name)

    plan = plan_dense_warmup(
        enable_prefill_cp=bool(value("enable_prefill_cp")),
        attn_cp_size=int(value("attn_cp_size") or 1),
        cp_strategy=value("cp_strategy"),
        moe_dense_tp_size=value("moe_dense_tp_size"),
        moe_a2a_backend=value("moe_a2a_backend"),
        disaggregation_mode=value("disaggregation_mode"),
        max_running_requests=value("max_running_requests"),
        speculative_algorithm=value("speculative_algorithm"),
        speculative_num_draft_tokens=value("speculative_num_draft_tokens"),
        draft_extend_under_cp=draft_extends_under_cp(),
    )
    configure(plan)
    return plan


def shape_m_list(kernel_type_name: str, n: int, k: int, num_groups: int, full_m_list: Sequence[int]) -> list:
    """Hook for ``_maybe_compile_deep_gemm_one_type_all``: this shape's Ms, logged with the count."""
    m_list = warmup_m_list(_plan, kernel_type_name, num_groups, full_m_list)
    if len(m_list) < len(full_m_list):
        why = f"per-rank Ms up to {max(m_list)} under prefill CP over {_plan.cp_divisor} ranks"
    elif _plan.cp_divisor <= 1:
        why = f"full list: {_plan.reason}"
    else:
        why = "full list: grouped MoE GEMMs run at full M"
    logger.info(
        "DeepGEMM warmup <%s> N=%d K=%d num_groups=%d: %d of %d Ms (%s)",
        kernel_type_name,
        n,
        k,
        num_groups,
        len(m_list),
        len(full_m_list),
        why,
    )
    return m_list
