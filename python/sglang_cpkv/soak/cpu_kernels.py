"""Where Triton runs in its interpreter (a CPU), three of upstream's kernels take most of a soak batch (about a
millisecond per program, a program per token): the packed FP8 latent row's quantizer (``quantize_k_cache_separate``),
the index key's (``act_quant``) and the index-K store's fallback (``SetKAndS``, the CPU path; a GPU takes the fused
store). :func:`install` replaces them with torch forms, byte for byte the same on the soak's rows
(``test/registered/soak`` proves each against the interpreter); every other Triton kernel runs as it is, and on a GPU
nothing is replaced. Called by :mod:`.server` at a soak process's start.
"""

from __future__ import annotations

import torch

from sglang_cpkv.soak import kv_function


def latent_fp8(k_nope: torch.Tensor, k_rope: torch.Tensor, group_size: int = 128):
    """``_quantize_k_cache_fast_separate``: ``(nope fp8 | scales, rope)`` uint8 ``[n, 1, ...]`` of the soak's rows."""
    if group_size != kv_function.TILE or k_nope.shape[1] != kv_function.NOPE:
        raise ValueError(f"the torch FP8 quantizer covers the soak's rows only, got {tuple(k_nope.shape)}")
    packed = kv_function.packed_fp8_rows(k_nope, k_rope)
    split = kv_function.NOPE + 4 * (kv_function.NOPE // kv_function.TILE)
    return packed[:, :split].contiguous().unsqueeze(1), packed[:, split:].contiguous().unsqueeze(1)


def index_key_fp8(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None):
    """``act_quant``: ``(fp8 keys, fp32 scales [..., 1])`` of the soak's index keys."""
    if block_size != kv_function.TILE or x.shape[-1] != kv_function.INDEX_DIM or scale_fmt is not None:
        raise ValueError(f"the torch index-key quantizer covers the soak's keys only, got {tuple(x.shape)}")
    q, scale = kv_function.index_k_fp8(x.reshape(-1, x.shape[-1]))
    return q.view(torch.float8_e4m3fn).reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


def index_k_store(buf, loc, index_k, index_k_scale, page_size: int) -> None:
    """``_set_k_and_s_triton``: token ``loc`` of page ``loc // page_size`` holds its 128 key bytes at
    ``offset * 128`` and its fp32 scale at ``page_size * 128 + offset * 4`` of the page's row."""
    loc = loc.to(torch.int64)
    page, offset = loc // page_size, loc % page_size
    rows = buf.view(buf.shape[0], -1)
    dim = index_k.shape[1]
    rows[page[:, None], offset[:, None] * dim + torch.arange(dim)] = index_k.contiguous().view(torch.uint8)
    scales = index_k_scale.reshape(-1).contiguous().view(torch.uint8).view(-1, 4)
    rows[page[:, None], page_size * dim + offset[:, None] * 4 + torch.arange(4)] = scales


def install() -> None:
    from sglang.kernels.ops.kvcache import dsa_index_k_cache
    from sglang.kernels.ops.quantization import act_quant_triton, dsa_quant_k_cache

    dsa_quant_k_cache._quantize_k_cache_fast_separate = latent_fp8
    act_quant_triton.act_quant = index_key_fp8
    dsa_index_k_cache._set_k_and_s_triton = index_k_store
