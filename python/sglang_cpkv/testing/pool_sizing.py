"""Upstream's KV pool sizing for a resolved server, on any machine (the configurator a model runner builds).

:func:`pool_configurator` resolves a real ``ServerArgs``, publishes it as a scheduler does, and builds upstream's
``KVCacheConfigurator`` and ``DefaultPoolConfigurator`` (the pool sizing DSA models use) for it: the patched
configurator charges the CP shared-KV reservation there (``hooks/reservation.py``). Needs the pinned upstream;
the caller makes ``torch.cuda.get_device_capability`` answer for the GPU it plays.
"""

from __future__ import annotations

from typing import Any

import torch


def prefill_cp_server(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """``ServerArgs`` keywords of a P/D prefill server with DSA prefill CP 8 (TP 8, interleave, Mooncake): the
    server the reservation tests and benchmark size (``overrides`` win)."""
    return dict(
        model_path=model_dir,
        skip_tokenizer_init=True,
        device="cuda",
        tp_size=8,
        enable_prefill_cp=True,
        cp_strategy="interleave",
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake",
        **overrides,
    )


def pool_configurator(server: dict[str, Any], *, layers: int, page_size: int, draft_worker: bool = False):
    """``(server_args, DefaultPoolConfigurator)`` for ``ServerArgs(**server)`` with ``layers`` layers of FP8 KV."""
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = ServerArgs(**server)
    args.resolve_once()
    runtime_context.get_context().set_server_args(args)
    kvc = KVCacheConfigurator(
        device="cuda",
        gpu_id=0,
        attn_dp_size=1,
        pp_size=1,
        pp_group=None,
        model=None,
        model_config=ModelConfig.from_server_args(args),
        server_args=args,
        kv_cache_dtype=torch.float8_e4m3fn,
        model_dtype=torch.bfloat16,
        page_size=page_size,
        sliding_window_size=None,
        spec_algorithm=SpeculativeAlgorithm.from_string(args.speculative_algorithm),
        is_draft_worker=draft_worker,
        post_capture_kv_active=False,
        spec_aux_config=SpecAuxHiddenStateConfig(eagle_draft_num_layers=1 if args.speculative_algorithm else None),
        is_hybrid_swa=False,
        is_hybrid_swa_compress=False,
        use_mla_backend=True,
        layer_info=ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers),
        forward_stream=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )
    return args, DefaultPoolConfigurator(kvc)
