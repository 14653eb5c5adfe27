"""Start-up validation of ``--enable-cp-shared-kv`` (called from upstream's resolution pipeline).

``patches/core/add-cp-shared-kv-server-flag.patch`` adds the field ``enable_cp_shared_kv`` to
``srt/arg_groups/fields/parallel.py`` and runs :func:`validate_cp_shared_kv_args` right after
``handle_kv_cache_sharding`` in ``srt/arg_groups/pipeline.py``, when the DSA overrides, the CP size, the page size
and the DSA backends are resolved; with the flag off the hook returns at once. What it refuses and why:
``docs/design/cp-shared-kv.md`` section 2 and the compatibility table (``REFUSED_FEATURES``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_cpkv.envs import envs
from sglang_cpkv.hooks.hicache import validate_hicache_args
from sglang_cpkv.hooks.settings import DRAFT_SHARED_KV_ENV, FLAG, draft_extends_under_cp

REQUIRED_PAGE_SIZE = 64
REQUIRED_CP_STRATEGY = "interleave"
# DSA prefill backends whose cache write and KV read go through DeepseekSparseAttnBackend.forward_extend
# (the hooked path). triton_sparse_mla reads the dense view as flashmla_sparse does (the same tables, PAGED or
# RAGGED; its output equals the mode-off run on the H200: test_cp_shared_kv_kit_cuda.py). trtllm writes from
# _forward_trtllm; the others are not DSA CUDA prefill paths we cover.
SUPPORTED_DSA_PREFILL_BACKENDS = ("flashmla_sparse", "flashmla_kv", "flashmla_auto", "triton_sparse_mla")
# The owned-page filter of the DSA indexer state (index K) is wired into Mooncake's sender only.
SUPPORTED_TRANSFER_BACKENDS = ("mooncake",)
ALL_CP_RANKS_TRANSFER_ENV = envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.name


def _refuse(reason: str) -> None:
    raise ValueError(f"{FLAG}: {reason}")


@dataclass(frozen=True)
class Refusal:
    """A server feature the mode cannot serve (or has never run beside): refused at start-up when ``active``.

    ``docs/design/cp-shared-kv-compatibility.md`` lists every feature a P/D prefill server can turn on beside the
    mode as proven (a test drives upstream's objects through the patched path) or refused (a row here, or a check
    of :func:`validate_cp_shared_kv_args`); the start-up test proves each refusal.
    """

    flag: str
    why: str
    active: Callable[[Any], bool]


REFUSED_FEATURES: tuple[Refusal, ...] = (
    Refusal(
        "--enable-flexkv",
        "FlexKV loads KV from outside into page ids without the owner narrowing of upstream's sharded HiCache path",
        lambda c: bool(c.enable_flexkv),
    ),
    Refusal(
        "--enable-unified-cache-external-linker",
        "the linker loads KV from outside into page ids without the owner narrowing of upstream's sharded HiCache path",
        lambda c: bool(c.enable_unified_cache_external_linker),
    ),
    Refusal(
        "--enable-hisparse",
        "HiSparse swaps the DSA pool and allocator for a logical-to-device page translation that the mode's dense-"
        "view tables do not go through",
        lambda c: bool(c.enable_hisparse),
    ),
    Refusal(
        "--enable-two-batch-overlap",
        "TboAttnBackend runs the DSA backend as a primary and two children, each of which would plan the batch and "
        "hold its own buffers, while the KV budget is charged one reserved set",
        lambda c: bool(c.enable_two_batch_overlap),
    ),
    Refusal(
        "--enable-dp-attention",
        "attention DP beside CP (attn_dp_size > 1: idle and padded DP batches, the P/D rank mapping of dp x cp) "
        "has not run with the mode",
        lambda c: c.attn_dp_size > 1,
    ),
    Refusal(
        "--attn-cp-size",
        "attention TP inside a CP rank (attn_cp_size x attn_dp_size < tp_size) has not run with the mode: set "
        "--attn-cp-size to the TP size",
        lambda c: c.attn_cp_size * c.attn_dp_size != c.tp_size,
    ),
    Refusal(
        "CP-TP group sharing (Glm5Next resolves it on)",
        "the CP group as the TP group has not run with the mode",
        lambda c: bool(c.enable_cp_tp_group_sharing),
    ),
    Refusal(
        "--cuda-graph-backend-prefill",
        "a captured prefill replays without the mode's per-batch plan (host inputs, buffers)",
        lambda c: c.cuda_graph_config.prefill.backend != "disabled",
    ),
    Refusal(
        "--enable-torch-compile",
        "a compiled forward would trace the mode's per-batch host state; not run with the mode",
        lambda c: bool(c.enable_torch_compile),
    ),
    Refusal(
        "--enable-mixed-chunk",
        "the mode plans EXTEND batches only (a MIXED batch would read the owner-sharded pool); a P/D prefill server "
        "has no decoding requests to mix in",
        lambda c: bool(c.enable_mixed_chunk),
    ),
    Refusal(
        "--enable-dynamic-chunking",
        "the chunk size would vary per step, while the mode's current-row buffers are reserved for "
        "--chunked-prefill-size",
        lambda c: bool(c.enable_dynamic_chunking),
    ),
    Refusal(
        "--enable-lora",
        "LoRA adapters have not run with the mode",
        lambda c: bool(c.enable_lora) or bool(c.lora_paths),
    ),
    Refusal(
        "--enable-priority-scheduling",
        "priority scheduling and its preemption have not run with the mode's admission hook",
        lambda c: bool(c.enable_priority_scheduling),
    ),
    Refusal(
        "--disaggregation-enable-kv-checksum",
        "each rank would digest every page of a request, but holds only the pages it owns",
        lambda c: bool(c.disaggregation_enable_kv_checksum),
    ),
    Refusal(
        "--enable-pd-role-switch",
        "a switch to decode would decode from an owner-sharded pool; the mode needs the prefill role for the life "
        "of the server",
        lambda c: bool(c.enable_pd_role_switch),
    ),
    Refusal(
        "--enable-return-indexer-topk",
        "the returned top-k would be dense-view locations of the mode, not pool locations",
        lambda c: bool(c.enable_return_indexer_topk),
    ),
    Refusal(
        "--enable-return-routed-experts",
        "upstream sizes the routed-experts capture buffer for one rank's pool and writes it at out_cache_loc, whose "
        "page ids span cp x that range under the mode (an IndexError once about 1/cp of the pool is in use)",
        lambda c: bool(c.enable_return_routed_experts),
    ),
    Refusal(
        "--dsa-triton-union",
        "a union of adjacent queries' top-k indices spans request boundaries of the batch; not run with the mode",
        lambda c: bool(c.dsa_triton_union),
    ),
    Refusal(
        "--enable-cp-decode-attn-tp",
        "a decode-side setting; a server of the mode only prefills",
        lambda c: bool(c.enable_cp_decode_attn_tp),
    ),
    Refusal(
        "--enable-pdmux",
        "PD multiplexing runs prefill and decode in one server; a server of the mode only prefills",
        lambda c: bool(c.enable_pdmux),
    ),
    Refusal(
        "--enable-memory-saver",
        "the mode's reserved buffers are outside the saver's KV region, so a release would free less than it says",
        lambda c: bool(c.enable_memory_saver),
    ),
    Refusal(
        "--kv-canary",
        "the KV canary sweeps every page of the pool, of which a rank holds only the pages it owns",
        lambda c: c.kv_canary != "none" or c.kv_canary_real_data != "none",
    ),
    Refusal(
        "--speculative-draft-kv-cache-dtype",
        "the draft's pool must have the target's layout (its extend runs the mode's hooks on it)",
        lambda c: c.speculative_draft_kv_cache_dtype is not None,
    ),
    Refusal(
        "--speculative-draft-attention-backend",
        "the draft's extend must run the target's DSA backend (the mode's hooks)",
        lambda c: c.speculative_draft_attention_backend is not None,
    ),
    Refusal(
        "--enable-multi-layer-eagle",
        "only the one-layer EAGLE/NextN draft has run with the mode",
        lambda c: bool(c.enable_multi_layer_eagle),
    ),
    Refusal(
        "--speculative-adaptive",
        "a varying number of draft steps has not run with the mode",
        lambda c: bool(c.speculative_adaptive),
    ),
    Refusal(
        "--decoupled-spec-role",
        "decoupled speculative decoding has not run with the mode",
        lambda c: c.decoupled_spec_role != "null",
    ),
    # The mode's page ids come from upstream's page-interleave allocator (hooks/page_ids.py), which admits only what
    # upstream's kv-sharding admits around it: the built-in radix cache with its rotation-aware tree core.
    Refusal(
        "--radix-cache-backend",
        "the page-interleave allocator of the mode's page ids needs upstream's built-in UnifiedRadixCache, whose "
        "tree core tracks the allocator's rotation bases (upstream refuses it under kv-sharding for the same reason)",
        lambda c: c.radix_cache_backend is not None,
    ),
    Refusal(
        "--enable-streaming-session",
        "a streaming session's virtual radix nodes carry no rotation base of the page-interleave allocator of the "
        "mode's page ids (refused by upstream's kv-sharding for the same reason)",
        lambda c: bool(c.enable_streaming_session),
    ),
    Refusal(
        "--enable-session-radix-cache",
        "the session radix cache has not run with the page-interleave allocator of the mode's page ids (refused by "
        "upstream's kv-sharding too)",
        lambda c: bool(c.enable_session_radix_cache),
    ),
)
TREE_CORE_ENV = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.name


def _check_tree_core(cfg: Any) -> None:
    """The radix tree core the page-interleave allocator needs (``hooks/page_ids.py``): upstream's Python
    ``UnifiedTreeCore``, the one that tracks rotation bases. Unset, :func:`_use_rotation_aware_tree_core` chooses it
    once every check has passed (as upstream's kv-sharding resolution does); another explicit choice is refused while
    the radix cache is on."""
    core = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND
    if core.is_set() and not cfg.disable_radix_cache and core.get() != "python":
        _refuse(
            f"requires {TREE_CORE_ENV}=python (or unset) with the radix cache on, got {core.get()!r}: that core does "
            "not track rotation bases (its supports_rotation_base is false), so a cached path could graft pages of "
            "another rotation base and its page owners would not be one cyclic run of the page-interleave allocator"
        )


def _use_rotation_aware_tree_core() -> None:
    """Choose the Python tree core where the operator did not (after every check: a refused start-up leaves the
    environment as it was)."""
    core = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND
    if not core.is_set():
        core.set("python")


def _validate_draft(algorithm_name: str) -> None:
    """Speculative decoding with the mode (design section 7).

    The draft's DSA backend runs the same hooks as the target's, so its pool is owner-sharded too:
    a draft extend that read it un-split on one rank would miss the pages other ranks own. On a
    P/D prefill server the only draft extend is the prefill-time one (decode-time DRAFT_EXTEND_V2
    runs on the decode server), an EXTEND batch that follows the target's CP split for drafts of
    the target's layout (EAGLE / NextN / MTP), so it gets its own per-request plan and dense view.
    ``SGLANG_CPKV_DRAFT_SHARED_KV=1`` is required as the explicit declaration that the draft's KV is
    CP-shared and its extend runs under CP (:func:`~.settings.draft_extends_under_cp`).
    Drafts that run their extend without CP (EAGLE3, DFLASH, DSpark: SINGLE_GROUP layouts) or
    whose draft path is not the DSA NextN one are refused.
    """
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algorithm = SpeculativeAlgorithm.from_string(algorithm_name)
    if algorithm is not SpeculativeAlgorithm.EAGLE:
        _refuse(
            f"supports speculative decoding with --speculative-algorithm EAGLE (or NEXTN: the DSA NextN/MTP "
            f"draft, which extends under the target's CP split) only, got {algorithm_name!r}"
        )
    if not draft_extends_under_cp():
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

    cfg = resolving_view(server_args)
    if not cfg.enable_cp_shared_kv:
        if cfg.cp_shared_kv_max_batch_tokens is not None:
            raise ValueError(
                f"--cp-shared-kv-max-batch-tokens {cfg.cp_shared_kv_max_batch_tokens} needs {FLAG}: it sizes that "
                "mode's buffers, and without the mode it would be ignored"
            )
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
    for refusal in REFUSED_FEATURES:
        if refusal.active(cfg):
            _refuse(f"cannot be combined with {refusal.flag}: {refusal.why}")
    validate_hicache_args(cfg)
    if cfg.disaggregation_transfer_backend not in SUPPORTED_TRANSFER_BACKENDS:
        _refuse(
            f"supports --disaggregation-transfer-backend in {SUPPORTED_TRANSFER_BACKENDS} (the owned-page filter "
            f"of the DSA indexer state is wired there), got {cfg.disaggregation_transfer_backend!r}"
        )
    _validate_reservation(cfg, model_config_of(server_args).context_len)
    _check_tree_core(cfg)
    if not envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get():
        _refuse(
            f"requires {ALL_CP_RANKS_TRANSFER_ENV}=1 on this prefill server: every CP rank sends the pages it "
            "owns (its decode servers learn the mode from the bootstrap info and pull from every CP rank)"
        )
    _use_rotation_aware_tree_core()
