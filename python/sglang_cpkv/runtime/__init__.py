"""CP shared-KV runtime (torch only, on the ops of :mod:`sglang_cpkv.ops`).

Per batch: :func:`build_plan` -> :class:`CpSharedKvPlan` (once, never per layer). Per layer:
:mod:`.layer` (materialize history, fill current, remap top-k, persist owned rows), optionally
through :class:`HistoryPrefetcher` (layer-ahead). CP collectives go through a :class:`CpGroup`
(:class:`SingleRankGroup` for cp=1, :class:`TorchDistCpGroup` over torch.distributed).
Checked mode: ``SGLANG_CPKV_CHECKED=1`` (:mod:`.checked`).
"""

from sglang_cpkv.runtime.buckets import PAGES_PER_REQUEST_BUCKETS, bucket_pages_per_request
from sglang_cpkv.runtime.checked import CHECKED_ENV_VAR
from sglang_cpkv.runtime.cp_split import CpSplit, CpStrategy, build_cp_split, split_applies
from sglang_cpkv.runtime.group import CpGroup, SingleRankGroup, TorchDistCpGroup
from sglang_cpkv.runtime.layer import (
    build_dense_view,
    fill_current,
    gather_current,
    materialize_history,
    new_dense_buffer,
    pack_owned_history,
    persist_owned_current,
    remap_topk,
    unpack_history,
)
from sglang_cpkv.runtime.plan import CpSharedKvPlan, build_plan
from sglang_cpkv.runtime.prefetch import HistoryPrefetcher

__all__ = [
    "CHECKED_ENV_VAR",
    "PAGES_PER_REQUEST_BUCKETS",
    "CpGroup",
    "CpSharedKvPlan",
    "CpSplit",
    "CpStrategy",
    "HistoryPrefetcher",
    "SingleRankGroup",
    "TorchDistCpGroup",
    "bucket_pages_per_request",
    "build_cp_split",
    "build_dense_view",
    "build_plan",
    "fill_current",
    "gather_current",
    "materialize_history",
    "new_dense_buffer",
    "pack_owned_history",
    "persist_owned_current",
    "remap_topk",
    "split_applies",
    "unpack_history",
]
