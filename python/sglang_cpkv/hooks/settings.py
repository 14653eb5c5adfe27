"""The CP shared-KV mode's settings in a server process, read in one place (their meaning: the README's settings).

Every hook module asks here whether the mode is on and how it runs; none imports another hook module for a setting
(so the hooks form no import circle).

* :func:`enabled` - ``--enable-cp-shared-kv`` of this process's published server args.
* :func:`layer_ahead` - ``SGLANG_CPKV_LAYER_AHEAD``: each layer's history prefetched a layer ahead on a side stream.
* :func:`max_batch_tokens` - ``--cp-shared-kv-max-batch-tokens``, or its default.
* :func:`draft_extends_under_cp` - ``SGLANG_CPKV_DRAFT_SHARED_KV`` (old name ``SGLANG_CP_DRAFT_SHARED_KV``): the
  operator's declaration that the speculative draft's extends run under the target's CP split.
"""

from __future__ import annotations

from sglang_cpkv.envs import envs
from sglang_cpkv.runtime.reservation import default_max_batch_tokens

FLAG = "--enable-cp-shared-kv"
LAYER_AHEAD_ENV = envs.SGLANG_CPKV_LAYER_AHEAD.name
DRAFT_SHARED_KV_ENV = envs.SGLANG_CPKV_DRAFT_SHARED_KV.name


def enabled() -> bool:
    """Whether this server runs with ``--enable-cp-shared-kv`` (its published args; off until they are published)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # not published in this process (yet)
        return False
    return bool(getattr(server_args, "enable_cp_shared_kv", False))


def layer_ahead(cp_size: int) -> bool:
    """Whether histories are prefetched one layer ahead or materialized by their own layer (one fused op).

    ``SGLANG_CPKV_LAYER_AHEAD`` decides when set (read at start-up: the reservation holds two dense views per kind
    for it, one without); by default layer-ahead under CP, where the history is an all-gather worth overlapping
    with the layer before, and synchronous at cp 1, where it is a local copy and the side stream costs more than
    it hides (benchmark/results/2026-12-01-h200-session3/NOTES.md, kit layer)."""
    setting = envs.SGLANG_CPKV_LAYER_AHEAD.get()
    return cp_size > 1 if setting is None else setting


def max_batch_tokens(limit: int | None, context_len: int, chunk_tokens: int, page_size: int) -> int:
    """The limit: ``--cp-shared-kv-max-batch-tokens`` when set, else the default of the context length and chunk."""
    return int(limit) if limit is not None else default_max_batch_tokens(context_len, chunk_tokens, page_size)


def draft_extends_under_cp() -> bool:
    """Whether ``SGLANG_CPKV_DRAFT_SHARED_KV=1`` (old name ``SGLANG_CP_DRAFT_SHARED_KV``) declares that the speculative
    draft's extends run under the target's CP split. A prefill server of the mode needs it for an EAGLE/NextN draft
    (the draft's pool is owner-sharded like the target's: start-up refuses the draft without it); on a server that
    decodes it tells the DeepGEMM warm-up that no draft extend runs at full M (``hooks/deep_gemm_warmup.py``)."""
    return envs.SGLANG_CPKV_DRAFT_SHARED_KV.get()
