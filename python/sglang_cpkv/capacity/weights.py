"""A lower bound on the weight bytes one GPU of a DSA server holds, from the model's ``config.json`` alone.

The parameters of a DeepSeek-V3-style DSA model (DeepSeek-V3.2, GLM-5.x) counted from its config (MLA attention, the
DSA indexer, dense MLPs, routed and shared experts, embedding and LM head; the MTP layers left out: a server loads
them only for speculative decoding): 743.9e9 for GLM-5 (published: 744e9), 671.9e9 for DeepSeek-V3.2 (671e9 + 14e9
MTP). Per GPU the attention and the indexer are split over the attention-TP ranks (``tp / (cp x dp)``), the rest
over TP, each parameter at the checkpoint's quantized width: a lower bound, so a KV budget computed with it is an
upper bound. Used by :func:`~.upstream.size_node` for the launcher's dry-run (``docs/operations.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
QUANTIZED_BYTES = {"fp8": 1}


def _field(config: Any, name: str, default: Any = None) -> Any:
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    return default if value is None else value


def parameter_counts(config: Any) -> tuple[int, int] | None:
    """(attention + indexer parameters of all layers, every other parameter) of a DSA model's config (a mapping or a
    ``PretrainedConfig``), or None when it lacks a field the count needs."""
    text = _field(config, "text_config", config)
    try:
        h = int(_field(text, "hidden_size"))
        layers = int(_field(text, "num_hidden_layers"))
        heads = int(_field(text, "num_attention_heads"))
        kv_rank = int(_field(text, "kv_lora_rank"))
        nope, rope = int(_field(text, "qk_nope_head_dim")), int(_field(text, "qk_rope_head_dim"))
        v = int(_field(text, "v_head_dim"))
        vocab = int(_field(text, "vocab_size"))
        dense_mlp = 3 * h * int(_field(text, "intermediate_size"))
        experts, shared = int(_field(text, "n_routed_experts")), int(_field(text, "n_shared_experts", 0))
        moe_mlp = 3 * h * int(_field(text, "moe_intermediate_size")) * (experts + shared) + h * experts
        dense_layers = min(layers, int(_field(text, "first_k_dense_replace", 0)))
    except (TypeError, ValueError):
        return None
    q_rank = int(_field(text, "q_lora_rank", 0))
    q_in = q_rank or h
    attention = (h * q_rank if q_rank else 0) + q_in * heads * (nope + rope)
    attention += h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h
    index_heads, index_dim = int(_field(text, "index_n_heads", 0)), int(_field(text, "index_head_dim", 0))
    attention += q_in * index_heads * index_dim + h * index_dim + h * index_heads
    embeddings = vocab * h * (1 if _field(text, "tie_word_embeddings", False) else 2)
    other = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp + embeddings
    return layers * attention, other


def bytes_per_parameter(config: Any) -> int | None:
    """The checkpoint's width of a weight: 1 for FP8, its dtype's when unquantized; None for another quantization."""
    quantization = _field(config, "quantization_config")
    if quantization:
        method = _field(quantization, "quant_method", "")
        return QUANTIZED_BYTES.get(str(method).lower())
    dtype = str(_field(config, "torch_dtype", _field(config, "dtype", "bfloat16"))).removeprefix("torch.")
    return DTYPE_BYTES.get(dtype)


def weight_bytes_per_gpu_lower_bound(config: Any, *, tp_size: int, attn_tp_size: int) -> int | None:
    """At least how many weight bytes one GPU of a server of ``tp_size`` / ``attn_tp_size`` holds (module docstring);
    None when the config cannot tell (another architecture, another quantization)."""
    counts, width = parameter_counts(config), bytes_per_parameter(config)
    if counts is None or width is None:
        return None
    attention, other = counts
    return width * (attention // attn_tp_size + other // tp_size)
