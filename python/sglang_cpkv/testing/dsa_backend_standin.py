"""Upstream's real DSA attention backend for CPU tests, built without a model runner.

``DeepseekSparseAttnBackend.__init__`` reads a model runner (GPU properties, server args) to derive
plain attributes; tests build the object with ``object.__new__`` and set exactly those attributes
here, so the methods under test (``init_forward_metadata``, ``forward_extend``, the MTP seed export)
are upstream's own, patched by our queue. This module imports no sglang itself: callers pass the
classes and pools they built.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def make_dsa_backend(backend_cls: type, token_to_kv_pool, req_to_token_pool, page_size: int):
    """An instance of ``backend_cls`` (upstream's DeepseekSparseAttnBackend) over the given pools.

    The settings are those of an SM90 prefill server with bf16 KV and the flashmla_sparse prefill
    implementation, fused top-k on, no CUDA graph, no speculative draft tokens.
    """
    backend = object.__new__(backend_cls)
    attrs = dict(
        token_to_kv_pool=token_to_kv_pool,
        req_to_token_pool=req_to_token_pool,
        req_to_token=req_to_token_pool.req_to_token,
        _kv_shard_pool=None,
        _is_in_breakable_cuda_graph=lambda: False,
        _is_in_tc_piecewise_cuda_graph=lambda: False,
        _get_device_sm=lambda: 90,
        _is_blackwell=lambda: False,
        supports_mha_one_shot=False,
        hisparse_coordinator=None,
        enable_auto_select_prefill_impl=False,
        dsa_kv_cache_store_fp8=False,
        dsa_prefill_impl="flashmla_sparse",
        dsa_decode_impl="fa3",
        dsa_index_kpool=1,
        dsa_index_topk=2048,
        physical_page_size=page_size,
        device="cpu",
        speculative_num_draft_tokens=0,
        use_fused_topk=True,
        _arange_buf=torch.arange(16384, dtype=torch.int32),
        dsa_topk_backend=SimpleNamespace(should_use_topk_v2=lambda: False, is_sgl_kernel=lambda: True),
    )
    for name, value in attrs.items():
        setattr(backend, name, value)
    return backend
