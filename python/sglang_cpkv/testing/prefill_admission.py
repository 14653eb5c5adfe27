"""Upstream's scheduler-side objects of one P/D prefill server, on CPU, for admission tests (TEST-ONLY).

:class:`AdmissionWorld` resolves a real ``ServerArgs``, builds the pools, the token allocator upstream's configurator
builds for it (the mode's page-interleave allocator under CP, ``--enable-kv-cache-sharding``'s, or the plain paged
one), upstream's default tree cache and the ``PrefillAdder`` as ``Scheduler._get_new_batch_prefill_raw`` does, and
runs one pass of its waiting-queue loop. Callers: ``test_cp_shared_kv_admission.py``, ``test_owner_class_admission.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang_cpkv.upstream_import import install_torchvision_stub

install_torchvision_stub()

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker  # noqa: E402
from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.runtime_context import get_schedule  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from sglang_cpkv.hooks import page_ids as page_id_hooks  # noqa: E402
from sglang_cpkv.hooks import reservation as reservation_hooks  # noqa: E402
from sglang_cpkv.runtime.reservation import Reservation  # noqa: E402


class AdmissionWorld:
    """Pools, allocator, tree cache and adder of one prefill server (see the module docstring)."""

    def __init__(
        self,
        monkeypatch: Any,
        server: dict,
        *,
        mode_on: bool,
        pool_tokens: int,
        rows: int,
        max_context: int,
        reservation: Callable[[], Reservation] | None = None,
        kv_cache_sharding: bool = False,
    ) -> None:
        """``server``: ``ServerArgs`` keywords; ``reservation``: with the mode on, what the pool-sizing hook
        publishes (made once the arguments are resolved); ``kv_cache_sharding``: with the mode off, the allocator
        ``--enable-kv-cache-sharding`` builds (shard size ``attn_cp_size``, its scratch spec left out), else the
        plain paged one."""
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
        monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
        args = ServerArgs(**server, enable_cp_shared_kv=mode_on)
        args.resolve_once()
        runtime_context.get_context().set_server_args(args)
        page = get_schedule().page_size
        self.req_to_token_pool = ReqToTokenPool(
            size=rows, max_context_len=max_context, device="cpu", enable_memory_saver=False
        )
        self.kv_pool = MLATokenToKVPool(
            pool_tokens,
            page_size=page,
            dtype=torch.bfloat16,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        if mode_on:  # the pool configurator's hook publishes the reservation before any allocator is built
            reservation_hooks.publish(reservation())
        if page_id_hooks.widens_page_ids():
            self.allocator = page_id_hooks.page_interleave_allocator(
                pool_tokens, page, torch.bfloat16, "cpu", self.kv_pool, False
            )
        elif kv_cache_sharding:
            self.allocator = PageInterleavePoolAllocator(
                pool_tokens,
                physical_page_size=page,
                shard_size=args.attn_cp_size,
                dtype=torch.bfloat16,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=False,
                shard_spec=None,
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                pool_tokens, page_size=page, dtype=torch.bfloat16, device="cpu", kvcache=self.kv_pool, need_sort=False
            )
        self.tree_cache = UnifiedRadixCache(
            CacheInitParams(
                disable=args.disable_radix_cache,  # as upstream's cache builder gives it
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=page,
                tree_components=(ComponentType.FULL,),
            )
        )
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)  # P/D prefill: nothing decodes here

    def adder(self, waiting: list[Req]) -> PrefillAdder:
        """The adder as ``Scheduler._get_new_batch_prefill_raw`` builds it (no mixed chunk, no delayer)."""
        schedule = get_schedule()
        return PrefillAdder(
            schedule.page_size,
            self.tree_cache,
            self.allocator,
            self.running_batch,
            NewTokenRatioTracker.from_config().current,
            schedule.max_prefill_tokens,
            schedule.chunked_prefill_size,
            0,
            schedule.priority_scheduling_preemption_threshold,
            max_prefill_bs=0,
            max_running_requests=schedule.max_running_requests,
            prefill_max_requests=schedule.prefill_max_requests,
            prefill_delayer_single_pass=None,
            dllm_config=None,
            waiting_queue_len=len(waiting),
            prefill_tile_block_m=64,
        )

    def prefill_pass(self, waiting: list[Req]) -> tuple[PrefillAdder, dict[str, AddReqResult]]:
        """One pass of the scheduler's waiting-queue loop; returns the adder and each tried request's result."""
        adder = self.adder(waiting)
        results = {}
        for req in waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            req.init_next_round_input(self.tree_cache)
            results[req.rid] = res = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                break
        return adder, results
