"""CP shared-KV runtime (torch only, on the ops of :mod:`sglang_cpkv.ops`).

Per batch: :func:`build_plan` -> :class:`CpSharedKvPlan` (every per-batch value, computed once). Per
layer: :class:`LayerPipeline` (history, current rows, remap, owned persist; layer-ahead or
synchronous), the only place that sequence is written. Ownership of a page: :func:`page_owner`. CP
collectives go through a :class:`CpGroup` (:class:`SingleRankGroup` for cp=1,
:class:`TorchDistCpGroup` over torch.distributed). Checked mode: ``SGLANG_CPKV_CHECKED=1`` (:mod:`.checked`).
"""

from sglang_cpkv.runtime.buckets import MAX_ROUNDING, round_dense_slots
from sglang_cpkv.runtime.checked import CHECKED_ENV_VAR
from sglang_cpkv.runtime.cp_split import CpSplit, CpStrategy, build_cp_split, split_applies
from sglang_cpkv.runtime.group import CpGroup, SingleRankGroup, TorchDistCpGroup, as_bytes
from sglang_cpkv.runtime.ownership import page_owner
from sglang_cpkv.runtime.pipeline import LayerPipeline, PagedKind, as_pages, rows_kind
from sglang_cpkv.runtime.plan import CpSharedKvPlan, build_plan

__all__ = [
    "CHECKED_ENV_VAR",
    "MAX_ROUNDING",
    "CpGroup",
    "CpSharedKvPlan",
    "CpSplit",
    "CpStrategy",
    "LayerPipeline",
    "PagedKind",
    "SingleRankGroup",
    "TorchDistCpGroup",
    "as_bytes",
    "as_pages",
    "build_cp_split",
    "build_plan",
    "page_owner",
    "round_dense_slots",
    "rows_kind",
    "split_applies",
]
