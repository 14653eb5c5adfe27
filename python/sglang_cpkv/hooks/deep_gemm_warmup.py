"""The DeepGEMM warmup M grid under DSA prefill CP (hooks in upstream 0.5.23's ``compile_utils.py``).

Upstream compiles one M list (1..m_max, m_max up to 128K) for every DeepGEMM shape it meets. Under
DSA prefill CP a rank's non-grouped GEMMs (``num_groups == 1``) can run at the per-rank M, about
``ceil(M / cp)``, while the grouped MoE GEMMs (contiguous and masked) run at the full M: the
all-to-all brings every routed token to its expert's rank whatever the CP split. Compiling the
non-grouped shapes for ``1..max(ceil(m_max / cp), 2048)`` only is safe exactly when *no*
non-grouped GEMM of this server ever runs a larger M. From reading 0.5.23 that needs all of:

1. **Prefill CP splits every token-heavy batch.** ``is_cp_active`` (``layers/cp/utils.py``) holds
   for EXTEND and MIXED only (``ForwardMode.is_context_parallel_extend``; no caller passes
   ``include_draft_extend_v2=True``, so decode-time draft extend, target verify and decode are never
   CP) and when the strategy's ``can_apply`` accepts the batch, else the batch runs un-split on every
   rank. *Interleave* refuses only batches of fewer than ``cp`` tokens (tiny M). *Zigzag* refuses a
   batch when any request extends fewer than ``2 * cp`` tokens, so at bs > 1 a short request drags a
   whole chunk (up to ``chunked_prefill_size`` tokens) to full M; its launch warning asks for
   batch size 1, which only ``--max-running-requests 1`` enforces.
2. **The FFN stays on the rank's rows.** Under DSA CP the layer boundary gathers an FFN's input over
   the attention-CP group unless the FFN computes on rank rows (``layer_boundary/factories.py:
   _ffn_on_rank_rows``): a dense FFN only with ``moe_dense_tp_size == 1``, a MoE (and its unfused
   shared experts) only with an all-to-all backend (``moe_a2a_backend`` not ``none``). Zigzag
   forces both (``model_overrides/deepseek_v2.py``); interleave forces neither, so by default its
   dense-MLP and shared-expert GEMMs run at the gathered M.
3. **No draft runs its extend at full M.** The prefill-time draft extend
   (``EAGLEWorkerV2._draft_extend_for_prefill``) is an EXTEND batch and follows the target's CP
   for target-layout drafts (DSA NextN / EAGLE, STANDALONE, ...), but SINGLE_GROUP drafts (EAGLE3,
   DFLASH, non-MoE DSpark: ``speculative/draft_parallel.py``) run it without CP; and on a server that
   decodes, the decode-time draft extend (DRAFT_EXTEND_V2) is never CP in 0.5.23. Either is a
   full-M draft extend. ``SGLANG_CPKV_DRAFT_SHARED_KV=1`` declares that the draft's extends run under
   CP (:func:`~.settings.draft_extends_under_cp`; the seed's meaning, here for the decode-time one); it
   cannot change a SINGLE_GROUP draft, whose CP upstream switches off.
4. **Non-CP batches stay small.** On a server that decodes, decode and target-verify batches run
   un-split with up to ``max_running_requests * speculative_num_draft_tokens`` rows; that bound
   joins the shrunk list's top, and an unbounded ``max_running_requests`` (unset) keeps the full list.
   A P/D prefill server never decodes.

Anything else keeps upstream's full list for every shape; the reason is logged per shape together
with how many Ms each shape compiles.
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
