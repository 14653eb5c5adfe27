"""Start-up validation of ``--enable-cp-shared-kv`` (called from upstream's resolution pipeline).

The patch ``patches/core/add-cp-shared-kv-server-flag.patch`` adds the field
``enable_cp_shared_kv`` to ``srt/arg_groups/fields/parallel.py`` and runs
:func:`validate_cp_shared_kv_args` right after ``handle_kv_cache_sharding`` in
``srt/arg_groups/pipeline.py``: by then the DSA model overrides, the CP size, the page size and the
DSA prefill/decode backends are resolved. With the flag off the hook returns at once.

The mode keeps only the pages a CP rank owns (``page_id % cp``) in that rank's pool, so the
server must be a P/D prefill worker whose every CP rank transfers its pages; the hooks cover the
DSA ``forward_extend`` path of the interleave strategy with page size 64.
"""

from __future__ import annotations

from typing import Any

FLAG = "--enable-cp-shared-kv"
REQUIRED_PAGE_SIZE = 64
REQUIRED_CP_STRATEGY = "interleave"
# DSA prefill backends whose cache write and KV read go through DeepseekSparseAttnBackend.forward_extend
# (the hooked path). triton_sparse_mla reads the dense view as flashmla_sparse does (the same tables, PAGED or
# RAGGED; its output equals the mode-off run on the H200: test_cp_shared_kv_kit_cuda.py). trtllm writes from
# _forward_trtllm; the others are not DSA CUDA prefill paths we cover.
SUPPORTED_DSA_PREFILL_BACKENDS = ("flashmla_sparse", "flashmla_kv", "flashmla_auto", "triton_sparse_mla")
# The owned-page filter of the DSA indexer state (index K) is wired into Mooncake's sender only.
SUPPORTED_TRANSFER_BACKENDS = ("mooncake",)
ALL_CP_RANKS_TRANSFER_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"


def _refuse(reason: str) -> None:
    raise ValueError(f"{FLAG}: {reason}")


def _validate_draft(algorithm_name: str) -> None:
    """Speculative decoding with the mode (design section 7).

    The draft's DSA backend runs the same hooks as the target's, so its pool is owner-sharded too:
    a draft extend that read it un-split on one rank would miss the pages other ranks own. On a
    P/D prefill server the only draft extend is the prefill-time one (decode-time DRAFT_EXTEND_V2
    runs on the decode server), an EXTEND batch that follows the target's CP split for drafts of
    the target's layout (EAGLE / NextN / MTP), so it gets its own per-request plan and dense view.
    ``SGLANG_CP_DRAFT_SHARED_KV=1`` is required as the explicit declaration that the draft's KV is
    CP-shared and its extend runs under CP (the DeepGEMM warmup gating reads the same variable).
    Drafts that run their extend without CP (EAGLE3, DFLASH, DSpark: SINGLE_GROUP layouts) or
    whose draft path is not the DSA NextN one are refused.
    """
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_cpkv.env import env_flag
    from sglang_cpkv.hooks.deep_gemm_warmup import DRAFT_SHARED_KV_ENV

    algorithm = SpeculativeAlgorithm.from_string(algorithm_name)
    if algorithm is not SpeculativeAlgorithm.EAGLE:
        _refuse(
            f"supports speculative decoding with --speculative-algorithm EAGLE (or NEXTN: the DSA NextN/MTP "
            f"draft, which extends under the target's CP split) only, got {algorithm_name!r}"
        )
    if not env_flag(DRAFT_SHARED_KV_ENV):
        _refuse(
            f"with --speculative-algorithm {algorithm_name} requires {DRAFT_SHARED_KV_ENV}=1: the draft's pool is "
            "owner-sharded like the target's, so its extend must run under the CP split with its own "
            "per-request plan (a draft extend at full M on one rank would read pages other ranks own)"
        )


def _validate_reservation(cfg: Any, context_len: int) -> None:
    """The limit the mode's buffers are reserved for (``runtime/reservation.py``) must hold any one request: the
    scheduler never defers a batch's first request, and its current tokens are bounded by the chunk size."""
    from sglang_cpkv.runtime.reservation import SETTING, page_rounded

    chunk = cfg.chunked_prefill_size
    if chunk is None or chunk <= 0:
        _refuse(
            f"requires chunked prefill (--chunked-prefill-size > 0, got {chunk}): the mode's current-row buffers "
            "are reserved for one chunk"
        )
    limit = cfg.cp_shared_kv_max_batch_tokens
    if limit is not None and limit < page_rounded(context_len, REQUIRED_PAGE_SIZE):
        _refuse(
            f"{SETTING} {limit} must hold one request of the context length ({context_len} tokens, "
            f"{page_rounded(context_len, REQUIRED_PAGE_SIZE)} page-rounded)"
        )


def validate_cp_shared_kv_args(server_args: Any) -> None:
    """Refuse every configuration the CP shared-KV hooks do not cover; a no-op with the flag off.

    Raises:
        ValueError: naming the flag, the offending setting and its value.
    """
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, model_config_of, resolving_view
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.environ import envs

    cfg = resolving_view(server_args)
    if not cfg.enable_cp_shared_kv:
        return

    if cfg.disaggregation_mode != "prefill":
        _refuse(
            f"requires a P/D prefill server (--disaggregation-mode prefill), got {cfg.disaggregation_mode!r}: "
            "each CP rank keeps only the pages it owns, so a rank cannot decode from its own pool"
        )
    architectures = getattr(model_config_of(server_args).hf_config, "architectures", None) or ["<none>"]
    if not is_deepseek_dsa(model_config_of(server_args).hf_config):
        _refuse(
            f"requires a DSA model (DeepSeek-V3.2, GLM-5.x: an architecture with index_topk), got {architectures[0]}"
        )
    prefill_backend, _ = attention_backends_of(cfg)
    if prefill_backend != "dsa":
        _refuse(f"requires the dsa attention backend, got prefill attention backend {prefill_backend!r}")
    if cfg.device != "cuda":
        _refuse(f"requires --device cuda, got {cfg.device!r}")
    if not cfg.enable_prefill_cp or cfg.attn_cp_size <= 1:
        _refuse(
            f"requires prefill context parallelism (--enable-prefill-cp with attn_cp_size > 1), got "
            f"enable_prefill_cp={cfg.enable_prefill_cp}, attn_cp_size={cfg.attn_cp_size}"
        )
    if cfg.cp_strategy != REQUIRED_CP_STRATEGY:
        _refuse(f"requires --cp-strategy {REQUIRED_CP_STRATEGY}, got {cfg.cp_strategy!r}")
    if cfg.pp_size != 1:
        _refuse(f"requires --pp-size 1, got {cfg.pp_size}")
    if cfg.page_size != REQUIRED_PAGE_SIZE:
        _refuse(f"requires page size {REQUIRED_PAGE_SIZE} (DSA index_kpool 1), got {cfg.page_size}")
    if cfg.dsa_prefill_backend not in SUPPORTED_DSA_PREFILL_BACKENDS:
        _refuse(f"supports --dsa-prefill-backend in {SUPPORTED_DSA_PREFILL_BACKENDS}, got {cfg.dsa_prefill_backend!r}")
    if cfg.enable_kv_cache_sharding:
        _refuse("cannot be combined with --enable-kv-cache-sharding (another page-owner scheme over the same pool)")
    if cfg.enable_dsa_cache_layer_split:
        _refuse("cannot be combined with --enable-dsa-cache-layer-split (layer ownership over the same pool)")
    if cfg.speculative_algorithm is not None:
        _validate_draft(cfg.speculative_algorithm)
    if cfg.disaggregation_transfer_backend not in SUPPORTED_TRANSFER_BACKENDS:
        _refuse(
            f"supports --disaggregation-transfer-backend in {SUPPORTED_TRANSFER_BACKENDS} (the owned-page filter "
            f"of the DSA indexer state is wired there), got {cfg.disaggregation_transfer_backend!r}"
        )
    _validate_reservation(cfg, model_config_of(server_args).context_len)
    if not envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get():
        _refuse(
            f"requires {ALL_CP_RANKS_TRANSFER_ENV}=1 on this prefill server: every CP rank sends the pages it "
            "owns (its decode servers learn the mode from the bootstrap info and pull from every CP rank)"
        )
