"""Keep DSA prefill and decode backends on one FP8 KV row layout (hooks in upstream 0.5.23).

Under ``--kv-cache-dtype fp8_e4m3`` a DSA pool stores a token as a **raw** 576-byte row (``trtllm``, ``tilelang``)
or a **packed** 656-byte one (fp8 latent, an fp32 scale per 128 bytes, bf16 rope: every ``flashmla_*``,
``triton_sparse_mla``, ``flashinfer_sparse_mla``), chosen from the backends; upstream defaults an unset side to
``trtllm`` on SM>=10 whatever the other side is. Called from ``keep-dsa-fp8-backends-on-one-kv-layout.patch``
(:func:`fp8_layout_family_defaults`: an unset side joins the set side's family; :func:`check_fp8_layout_mix`: an
explicit mix on one pool fails at start-up) and ``refuse-pd-dsa-fp8-kv-layout-mismatch.patch``
(:func:`dsa_fp8_pd_kv_layout`, :func:`check_pd_fp8_layout_match`: a decode refuses a prefill of the other layout).
Why (``patches/upstream-fixes/``): ``patches/manifest.json``; ``docs/design/cp-shared-kv.md`` section 10.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

FP8_KV_DTYPE = "fp8_e4m3"
RAW = "raw"
PACKED = "packed"
FP8_SCALE_BLOCK = 128  # nope values per fp32 scale in the packed layout (DSATokenToKVPool.quant_block_size)

# The FP8 layout each backend reads. Backends absent here (fa3, triton, aiter, intel_xpu) are not
# FP8 DSA backends on CUDA; combinations with them keep upstream's behaviour.
FP8_LAYOUT_OF_BACKEND: Mapping[str, str] = {
    "trtllm": RAW,
    "tilelang": RAW,
    "flashmla_sparse": PACKED,
    "flashmla_kv": PACKED,
    "flashmla_auto": PACKED,
    "flashmla_sparse_q8": PACKED,
    "triton_sparse_mla": PACKED,
    "flashinfer_sparse_mla": PACKED,
}

PREFILL_FLAG = "--dsa-prefill-backend"
DECODE_FLAG = "--dsa-decode-backend"


def fp8_row_bytes(layout: str, *, kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes per token of a DSA FP8 KV row in ``layout`` (raw 576 / packed 656 for 512 + 64)."""
    if layout == RAW:
        return kv_lora_rank + qk_rope_head_dim
    if layout == PACKED:
        if kv_lora_rank % FP8_SCALE_BLOCK:
            raise ValueError(f"kv_lora_rank={kv_lora_rank} is not a multiple of the FP8 scale block {FP8_SCALE_BLOCK}")
        return kv_lora_rank + kv_lora_rank // FP8_SCALE_BLOCK * 4 + qk_rope_head_dim * 2
    raise ValueError(f"unknown DSA FP8 KV layout {layout!r}; expected {RAW!r} or {PACKED!r}")


def describe_layout(layout: str, *, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64) -> str:
    """Human words for a layout, e.g. ``packed 656-byte rows (512 fp8 + 16 scale bytes + 64 bf16 rope)``."""
    row = fp8_row_bytes(layout, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
    if layout == RAW:
        return f"raw {row}-byte rows ({kv_lora_rank} + {qk_rope_head_dim} fp8, no scales)"
    scale_bytes = kv_lora_rank // FP8_SCALE_BLOCK * 4
    return f"packed {row}-byte rows ({kv_lora_rank} fp8 + {scale_bytes} scale bytes + {qk_rope_head_dim} bf16 rope)"


def _family_default(user_backend: str, *, for_prefill: bool, sm_major: int) -> str | None:
    """The backend an unset side gets so that it reads the same rows as ``user_backend``."""
    layout = FP8_LAYOUT_OF_BACKEND.get(user_backend)
    if layout is None:
        return None
    if user_backend in ("trtllm", "tilelang"):
        # CUDA TileLang FP8 must be on both sides (upstream's _check_dsa_backend_constraints).
        return user_backend
    if not for_prefill:
        return "flashmla_kv"  # FlashMLA's FP8 sparse decode kernel, upstream's Hopper FP8 decode default
    # Upstream's Hopper FP8 prefill default is flashmla_kv; on Blackwell flashmla_auto picks between
    # flashmla_kv and flashmla_sparse per batch (DSABackend.set_dsa_prefill_impl).
    return "flashmla_auto" if sm_major >= 10 else "flashmla_kv"


def fp8_layout_family_defaults(
    *, kv_cache_dtype: str, prefill_backend: str | None, decode_backend: str | None, sm_major: int
) -> dict:
    """Declarations for the unset backend when exactly one side is user-set in an FP8 layout family.

    Called in upstream's CUDA FP8 branch of ``_dsa_split_backend_resolution`` after its own defaults;
    the returned dict overrides them. Empty when nothing changes (bf16, both set, none set, or a
    user backend outside the two FP8 families).
    """
    if kv_cache_dtype != FP8_KV_DTYPE or (prefill_backend is None) == (decode_backend is None):
        return {}
    if prefill_backend is not None:
        default = _family_default(prefill_backend, for_prefill=False, sm_major=sm_major)
        return {} if default is None else {"dsa_decode_backend": default}
    default = _family_default(decode_backend, for_prefill=True, sm_major=sm_major)
    return {} if default is None else {"dsa_prefill_backend": default}


def check_fp8_layout_mix(
    *,
    kv_cache_dtype: str,
    prefill_backend: str | None,
    decode_backend: str | None,
    disaggregation_mode: str | None,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
) -> None:
    """Refuse FP8 prefill/decode backends that read different row layouts from one pool.

    On a P/D prefill or decode server only the local role's backend shapes the pool (upstream's
    ``calculate_mla_kv_cache_dim``), so a mix there is legal locally; the P/D handshake
    (:func:`check_pd_fp8_layout_match`) compares the two servers' pools instead.
    """
    if kv_cache_dtype != FP8_KV_DTYPE:
        return
    prefill_layout = FP8_LAYOUT_OF_BACKEND.get(prefill_backend or "")
    decode_layout = FP8_LAYOUT_OF_BACKEND.get(decode_backend or "")
    if prefill_layout is None or decode_layout is None or prefill_layout == decode_layout:
        return
    sizes = dict(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
    if disaggregation_mode in ("prefill", "decode"):
        local_flag = PREFILL_FLAG if disaggregation_mode == "prefill" else DECODE_FLAG
        local_layout = prefill_layout if disaggregation_mode == "prefill" else decode_layout
        logger.warning(
            "%s %s and %s %s read different FP8 KV layouts; on this P/D %s server only %s decides the pool "
            "(%s), and the %s server must store the same rows.",
            PREFILL_FLAG,
            prefill_backend,
            DECODE_FLAG,
            decode_backend,
            disaggregation_mode,
            local_flag,
            describe_layout(local_layout, **sizes),
            "decode" if disaggregation_mode == "prefill" else "prefill",
        )
        return
    fix_decode = _family_default(prefill_backend, for_prefill=False, sm_major=10)
    fix_prefill = _family_default(decode_backend, for_prefill=True, sm_major=10)
    raise ValueError(
        f"DSA FP8 KV layout mix: {PREFILL_FLAG} {prefill_backend} reads {describe_layout(prefill_layout, **sizes)}, "
        f"but {DECODE_FLAG} {decode_backend} reads {describe_layout(decode_layout, **sizes)}; both read the one KV "
        f"pool of this server under --kv-cache-dtype {FP8_KV_DTYPE}, so one of them would read the other's rows "
        f"as garbage. Fix: use one layout family on both sides, e.g. {DECODE_FLAG} {fix_decode} or "
        f"{PREFILL_FLAG} {fix_prefill} (or leave one flag unset: it then follows the other), "
        f"or use --kv-cache-dtype bfloat16."
    )


PD_LAYOUT_PREFIX = "dsa-fp8-"


def dsa_fp8_pd_kv_layout(token_to_kv_pool) -> str | None:
    """The DSA FP8 row layout a P/D peer must share (``dsa-fp8-packed-656B``), else None.

    None for pools that are not DSA or not FP8: they keep upstream's handshake unchanged.
    """
    if not getattr(token_to_kv_pool, "use_dsa", False):
        return None
    if getattr(token_to_kv_pool, "dtype", None) != torch.float8_e4m3fn:
        return None
    layout = PACKED if getattr(token_to_kv_pool, "dsa_kv_cache_store_fp8", False) else RAW
    row_bytes = getattr(token_to_kv_pool, "kv_cache_dim", None)
    if not isinstance(row_bytes, int):
        raise ValueError(f"DSA FP8 pool {type(token_to_kv_pool).__name__} has no integer kv_cache_dim ({row_bytes!r})")
    return f"{PD_LAYOUT_PREFIX}{layout}-{row_bytes}B"


def _parse_pd_layout(value: str | None) -> tuple[str, int] | None:
    if not isinstance(value, str) or not value.startswith(PD_LAYOUT_PREFIX):
        return None
    layout, _, row = value[len(PD_LAYOUT_PREFIX) :].partition("-")
    if layout not in (RAW, PACKED) or not row.endswith("B") or not row[:-1].isdigit():
        raise ValueError(f"malformed DSA FP8 P/D KV layout {value!r}")
    return layout, int(row[:-1])


def _layout_words(layout: str, row_bytes: int) -> str:
    what = "no scales" if layout == RAW else "fp8 nope + fp32 scales + bf16 rope"
    return f"{layout} {row_bytes}-byte rows ({what})"


def check_pd_fp8_layout_match(*, prefill_layout: str | None, decode_layout: str | None) -> None:
    """On the decode side, before any KV moves: refuse a prefill server whose DSA FP8 rows differ.

    Silent when either side publishes no DSA FP8 layout (upstream's own ``kv_layout`` check still
    runs after this one).
    """
    prefill = _parse_pd_layout(prefill_layout)
    decode = _parse_pd_layout(decode_layout)
    if prefill is None or decode is None or prefill == decode:
        return
    decode_backend_for = {RAW: "trtllm", PACKED: "flashmla_kv"}
    prefill_backend_for = {RAW: "trtllm", PACKED: "flashmla_auto (or another flashmla_* backend)"}
    raise RuntimeError(
        f"DSA FP8 KV layout mismatch between P/D servers: the prefill server stores "
        f"{_layout_words(*prefill)} (chosen by its {PREFILL_FLAG}), this decode server stores "
        f"{_layout_words(*decode)} (chosen by its {DECODE_FLAG}); copying pages between them would corrupt "
        f"the KV. Fix: use one layout family on both servers, e.g. {DECODE_FLAG} {decode_backend_for[prefill[0]]} "
        f"on the decode server, or {PREFILL_FLAG} {prefill_backend_for[decode[0]]} on the prefill server."
    )
