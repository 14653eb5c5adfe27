"""The mode's reserved buffers in a server: charged to the KV budget at start-up, admitted against.

Called from ``patches/core/reserve-cp-shared-kv-buffers.patch``:

* :func:`pool_overhead_bytes` - ``DefaultPoolConfigurator.__init__`` (the DSA models' pool sizing), where
  upstream charges its own kv-sharding scratch (``compute_page_shard_scratch_bytes``) before the pool is
  sized: computes the :class:`~sglang_cpkv.runtime.reservation.Reservation` of this server, publishes it
  for the batch hooks, logs it, and returns its bytes. A draft worker's configurator returns 0: the
  target's reservation already counts the draft's backend (as upstream counts the kv-shard scratch of an
  EAGLE draft on the target).
* :func:`defers_request` - ``PrefillAdder.add_one_req``, before anything is reserved for the request:
  a request whose dense KV would take the batch past the limit waits for a later batch (history that requests
  share through the radix tree counts once, as the plan's shared history slots hold it once)
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
from sglang_cpkv.runtime.reservation import SETTING, Reservation

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


def _history_nodes(tree_cache: Any, req: Any) -> list[tuple[int, int]] | None:
    """``(node identity, tokens)`` of every radix node on the path from the root to ``req.last_node`` (host objects
    only), or None when that path does not hold exactly the request's ``prefix_len`` tokens (a disabled radix cache,
    a chunked continuation it does not keep): then the request's history counts as its own."""
    node = getattr(req, "last_node", None)
    core = getattr(tree_cache, "tree_core", None)
    if node is not None and not hasattr(node, "parent") and core is not None:
        node = core.node_by_id(node)  # a NodeId of upstream's unified tree
    path = []
    while node is not None and getattr(node, "parent", None) is not None and node.key is not None:
        path.append((id(node), len(node.key)))
        node = node.parent
    return path if sum(tokens for _, tokens in path) == req.prefix_len else None


def dense_pages(tree_cache: Any, requests: list[tuple[Any, int]], page_size: int) -> int:
    """Slots the batch's dense view needs for ``(request, end)`` pairs (its tokens ``[0, end)`` this round): the
    distinct history pages (the plan's history region: radix nodes several requests share count once) and each
    request's own pages (from its first page that takes current tokens). An upper bound of the plan's slots."""
    shared: dict[int, int] = {}
    region = own = 0
    for req, end in requests:
        prefix = req.prefix_len
        nodes = _history_nodes(tree_cache, req) if prefix else []
        if nodes is None:
            region += -(-prefix // page_size)
        else:
            shared.update(nodes)
        own += -(-end // page_size) - prefix // page_size
    return region + sum(-(-tokens // page_size) for tokens in shared.values()) + own


def defers_request(adder: Any, req: Any) -> bool:
    """Whether ``req`` waits for a later batch: the batch's dense view (:func:`dense_pages`, with the candidate's
    tokens up to the end of what the chunk budget leaves it; an upper bound, so a request may wait that would just
    have fit) would hold more than the limit."""
    reservation = _published
    if reservation is None or not adder.can_run_list:
        return False
    page_size = reservation.page_size
    end = len(req.full_untruncated_fill_ids)
    if adder.rem_chunk_tokens is not None:
        # An upper bound: upstream may round the chunk end down to a page. (No HiCache host hit extends the prefix:
        # start-up refuses HiCache beside the mode.)
        end = min(end, req.prefix_len + max(adder.rem_chunk_tokens, 0))
    batch = [(r, r.extend_end) for r in adder.can_run_list] + [(req, end)]
    wanted = dense_pages(adder.tree_cache, batch, page_size) * page_size
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
