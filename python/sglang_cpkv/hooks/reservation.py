"""The mode's reserved buffers in a server: charged to the KV budget at start-up, admitted against.

Called from ``patches/core/reserve-cp-shared-kv-buffers.patch``:

* :func:`pool_overhead_bytes` - ``DefaultPoolConfigurator.__init__`` (the DSA models' pool sizing), where
  upstream charges its own kv-sharding scratch (``compute_page_shard_scratch_bytes``) before the pool is
  sized: computes the :class:`~sglang_cpkv.runtime.reservation.Reservation` of this server, publishes it
  for the batch hooks, logs it, and returns its bytes. A draft worker's configurator returns 0: the
  target's reservation already counts the draft's backend (as upstream counts the kv-shard scratch of an
  EAGLE draft on the target).
* :func:`defers_request` - ``PrefillAdder.add_one_req``, before anything is reserved for the request:
  a request whose dense KV would take the batch past the limit waits for a later batch
  (``AddReqResult.OTHER``). The first request of a batch is never deferred (that would never end); start-up
  validation makes the limit hold one request of the full context length.

The batch hooks (:mod:`.dsa_extend`) size every buffer from :func:`published` and refuse a batch that does
not fit (:meth:`Reservation.check_batch`).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_cpkv.hooks.settings import layer_ahead, max_batch_tokens
from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime.reservation import SETTING, Reservation, page_rounded

logger = logging.getLogger(__name__)

_published: Reservation | None = None


def publish(reservation: Reservation) -> Reservation:
    """Make ``reservation`` this process's (start-up; test worlds that build upstream's objects themselves)."""
    global _published
    _published = reservation
    logger.info(reservation.describe())
    return reservation


def published() -> Reservation:
    """This process's reservation; a batch of the mode without one is refused (the pool sizing hook did not run)."""
    if _published is None:
        raise CpSharedKvError(
            "the CP shared-KV buffers were not reserved at start-up (the pool configurator hook of "
            "patches/core/reserve-cp-shared-kv-buffers.patch did not run)"
        )
    return _published


def index_k_token_bytes(hf_config: Any) -> int:
    """Bytes of one token of the DSA index-K pool: FP8 keys and one fp32 scale per quantization block."""
    from sglang.srt.configs.model_config import get_dsa_index_head_dim
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    head_dim = get_dsa_index_head_dim(hf_config)
    return head_dim + head_dim // DSATokenToKVPool.quant_block_size * 4


def pool_overhead_bytes(kvc: Any) -> int:
    """Bytes of the mode's buffers to charge before the KV pool is sized (0 with the mode off)."""
    server_args = kvc.server_args
    if not getattr(server_args, "enable_cp_shared_kv", False) or kvc.is_draft_worker:
        return 0
    import torch
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
    from sglang.srt.runtime_context import get_parallel, get_schedule

    cp_size = get_parallel().attn_cp_size
    chunk_tokens = get_schedule().chunked_prefill_size  # the resolved value (the field may still read None)
    model_config = kvc.model_config
    limit = resolving_view(server_args).cp_shared_kv_max_batch_tokens
    latent_dim = calculate_mla_kv_cache_dim(model_config=model_config, kv_cache_dtype=kvc.kv_cache_dtype)
    reservation = Reservation(
        max_batch_tokens=max_batch_tokens(limit, model_config.context_len, chunk_tokens, kvc.page_size),
        chunk_tokens=chunk_tokens,
        page_size=kvc.page_size,
        cp_size=cp_size,
        views_per_kind=2 if layer_ahead(cp_size) else 1,
        latent_token_bytes=latent_dim * torch._utils._element_size(kvc.kv_cache_dtype),
        index_k_token_bytes=index_k_token_bytes(model_config.hf_config),
        backends=2 if kvc.spec_algorithm.is_eagle() else 1,
    )
    return publish(reservation).total_bytes


def defers_request(adder: Any, req: Any) -> bool:
    """Whether ``req`` waits for a later batch: its dense KV this round (its tokens up to the end of what the
    chunk budget leaves it, page-rounded; an upper bound, so a request may wait that would just have fit) would
    take the batch's past the limit."""
    reservation = _published
    if reservation is None or not adder.can_run_list:
        return False
    page_size = reservation.page_size
    admitted = sum(page_rounded(r.extend_end, page_size) for r in adder.can_run_list)
    end = len(req.full_untruncated_fill_ids)
    if adder.rem_chunk_tokens is not None:
        # An upper bound: upstream may round the chunk end down to a page. (No HiCache host hit extends the prefix:
        # start-up refuses HiCache beside the mode.)
        end = min(end, req.prefix_len + max(adder.rem_chunk_tokens, 0))
    wanted = admitted + page_rounded(end, page_size)
    if wanted <= reservation.max_batch_tokens:
        return False
    logger.debug(
        "CP shared-KV: request %s waits: the batch would hold %d tokens of dense KV, %s is %d",
        getattr(req, "rid", "?"),
        wanted,
        SETTING,
        reservation.max_batch_tokens,
    )
    return True
