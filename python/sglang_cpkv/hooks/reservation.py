"""The mode's reserved buffers in a server: charged to the KV budget at start-up, admitted against.

Called from ``patches/core/reserve-cp-shared-kv-buffers.patch``: :func:`pool_overhead_bytes` in
``DefaultPoolConfigurator.__init__`` (beside upstream's kv-shard scratch) computes this server's
:class:`~sglang_cpkv.runtime.reservation.Reservation`, publishes it with the start-up settings as the mode's one
configuration (:class:`~.state.ModeConfig`), logs it and returns its bytes (0 for a draft worker: the target's
counts the draft's backend), and warms the ops up on the server's device (:func:`sglang_cpkv.ops.warm_up`: never
inside a forward); :func:`defers_request` in ``PrefillAdder.add_one_req`` makes a request whose dense KV
would take the batch past the limit wait (:class:`AdmissionTally`: history shared through the radix tree counts
once; never a batch's first request). Design: ``docs/design/cp-shared-kv.md`` section 2b.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_cpkv.hooks import state
from sglang_cpkv.hooks.settings import layer_ahead, max_batch_tokens
from sglang_cpkv.runtime import checked as checked_mode
from sglang_cpkv.runtime.reservation import SETTING, Reservation

logger = logging.getLogger(__name__)


def publish(reservation: Reservation) -> Reservation:
    """Make ``reservation`` this process's, with the settings read at start-up (:class:`~.state.ModeConfig`; test
    worlds that build upstream's objects themselves call it too)."""
    state.current().config = state.ModeConfig(reservation, checked=checked_mode.enabled())
    logger.info(reservation.describe())
    return reservation


def published() -> Reservation:
    """This process's reservation; a batch of the mode without one is refused (the pool sizing hook did not run)."""
    return state.config().reservation


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
        layer_ahead=layer_ahead(cp_size),
        latent_token_bytes=latent_dim * torch._utils._element_size(kvc.kv_cache_dtype),
        index_k_token_bytes=index_k_token_bytes(model_config.hf_config),
        backends=2 if kvc.spec_algorithm.is_eagle() else 1,
    )
    publish(reservation)
    from sglang_cpkv import ops

    ops.warm_up(kvc.device)  # loads and probes the ops' backend (the CUDA one synchronizes) before any batch
    return reservation.total_bytes


def _history_nodes(tree_cache: Any, req: Any) -> list[Any] | None:
    """Every radix node on the path from the root to ``req.last_node`` (host objects only), or None when that path
    does not hold exactly the request's ``prefix_len`` tokens (a disabled radix cache, a chunked continuation it does
    not keep): then the request's history counts as its own."""
    node = getattr(req, "last_node", None)
    core = getattr(tree_cache, "tree_core", None)
    if node is not None and not hasattr(node, "parent") and core is not None:
        node = core.node_by_id(node)  # a NodeId of upstream's unified tree
    path = []
    while node is not None and getattr(node, "parent", None) is not None and node.key is not None:
        path.append(node)
        node = node.parent
    return path if sum(len(node.key) for node in path) == req.prefix_len else None


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class AdmissionTally:
    """Slots the batch's dense view needs, of what one ``PrefillAdder`` admitted so far: the distinct history pages
    (the plan's history region: radix nodes several requests share count once) and each request's own pages (from its
    first page that takes current tokens); an upper bound of the plan's slots. Kept across the adder's
    ``add_one_req`` calls, so a candidate costs its own radix path, not every admitted request's (admission linear in
    the batch).

    A node is counted with its tokens when first seen. Upstream's ``match_prefix`` of a later request may split a
    counted node during the pass (``UnifiedTreeCore._split_node``: the node keeps its identity and its key's tail, a
    new parent takes the head): the first path through the new parent finds its counted child shorter than counted
    and counts both parts at their new lengths, as a walk of the whole batch would."""

    def __init__(self, tree_cache: Any, page_size: int) -> None:
        self.tree_cache, self.page_size = tree_cache, page_size
        self.counted, self.last = 0, None  # how many of the adder's requests are counted, and the last of them
        self.nodes: dict[int, tuple[Any, int]] = {}  # id(node) -> (node, its tokens as counted)
        self.pages = 0
        self.entries = 0  # page-table entries of the counted requests (each request's pages, shared or not)

    def catch_up(self, admitted: list[Any]) -> None:
        """Count the requests the adder admitted since the last call (its ``can_run_list``, at their ``extend_end``);
        start again when that list is not the one counted so far."""
        n = self.counted
        if len(admitted) < n or (n and admitted[n - 1] is not self.last):
            self.nodes, self.pages, self.entries, n = {}, 0, 0, 0
        for req in admitted[n:]:
            added = self._count(req, req.extend_end, commit=True)  # first: it may correct self.pages
            self.pages += added
            self.entries += _pages(req.extend_end, self.page_size)
        self.counted, self.last = len(admitted), admitted[-1] if admitted else None

    def with_candidate(self, req: Any, end: int) -> int:
        """The batch's pages with ``req`` (tokens ``[0, end)``) added; the tally itself keeps only what was admitted."""
        added = self._count(req, end, commit=False)  # first: it may correct self.pages
        return self.pages + added

    def _count(self, req: Any, end: int, commit: bool) -> int:
        """Pages ``req`` adds to the tally (its nodes kept when ``commit``). Splits found on its path are corrections
        of what was counted already, made to the tally either way."""
        page_size, prefix, added = self.page_size, req.prefix_len, 0
        path = _history_nodes(self.tree_cache, req) if prefix else []
        if path is None:
            added += _pages(prefix, page_size)
        else:
            new: dict[int, tuple[Any, int]] = {}
            for node in path:
                if id(node) in self.nodes or id(node) in new:
                    continue
                for child in getattr(node, "children", {}).values():  # a counted node split below this new one
                    counted = self.nodes.get(id(child))
                    if counted is not None and counted[1] != len(child.key):
                        self.pages += _pages(len(child.key), page_size) - _pages(counted[1], page_size)
                        self.nodes[id(child)] = (child, len(child.key))
                new[id(node)] = (node, len(node.key))
                added += _pages(len(node.key), page_size)
            if commit:
                self.nodes.update(new)
        return added + _pages(end, page_size) - prefix // page_size


def defers_request(adder: Any, req: Any) -> bool:
    """Whether ``req`` waits for a later batch: the batch's dense view (:class:`AdmissionTally`, with the candidate's
    tokens up to the end of what the chunk budget leaves it; an upper bound, so a request may wait that would just
    have fit) would hold more than the limit, or its page tables more entries than the reservation's plan bound
    (``Reservation.max_batch_entries``)."""
    config = state.current().config
    if config is None or not adder.can_run_list:
        return False
    reservation = config.reservation
    end = len(req.full_untruncated_fill_ids)
    if adder.rem_chunk_tokens is not None:
        # An upper bound: upstream may round the chunk end down to a page. A HiCache host hit is loaded back before the
        # chunk (into fresh page ids: counted as the request's own pages, from its device prefix on).
        end = min(end, req.prefix_len + req.host_hit_length + max(adder.rem_chunk_tokens, 0))
    tally = admission_tally(adder)
    wanted = tally.with_candidate(req, end) * reservation.page_size
    entries = tally.entries + _pages(end, reservation.page_size)
    if wanted <= reservation.max_batch_tokens and entries <= reservation.max_batch_entries:
        return False
    logger.debug(
        "CP shared-KV: request %s waits: the batch would hold %d tokens of dense KV and %d page-table entries, "
        "%s %d allows %d entries",
        getattr(req, "rid", "?"),
        wanted,
        entries,
        SETTING,
        reservation.max_batch_tokens,
        reservation.max_batch_entries,
    )
    return True


TALLY_ATTR = "cp_shared_kv_tally"  # the PrefillAdder attribute that holds its AdmissionTally


def admission_tally(adder: Any) -> AdmissionTally:
    """The adder's tally, brought up to date with its ``can_run_list`` (made on the adder's first candidate)."""
    tally = getattr(adder, TALLY_ATTR, None)
    if tally is None:
        tally = AdmissionTally(adder.tree_cache, published().page_size)
        setattr(adder, TALLY_ATTR, tally)
    tally.catch_up(adder.can_run_list)
    return tally
