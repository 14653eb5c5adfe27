"""Per cp: what a prefill node holds with the mode, with upstream's replicated CP and with upstream's kv-sharding,
and what the mode moves per layer for a batch (the rows :mod:`.cli` and :mod:`.report` print).

Every KV figure is upstream's own (:func:`~.upstream.size_node`); nothing here multiplies a per-rank pool by cp.
Three servers per cp on one model, GPU, budget, chunk and context: ``mode``, ``replicated`` and ``kv_sharding``
(cp > 1 only, with the trtllm backends it requires); ``kv_tokens_at_sharding_cell`` is the mode's node at
kv-sharding's smaller FP8 cell, for a like-for-like comparison. What each row means and why:
``docs/operations.md``, "The capacity planner" ("How it counts").
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_cpkv.capacity.presets import GpuPreset
from sglang_cpkv.capacity.traffic import LayerTraffic, layer_traffic
from sglang_cpkv.capacity.upstream import (
    NodeCapacity,
    playing_gpu,
    prefill_cp_server,
    size_node,
    upstream_mem_fraction,
)
from sglang_cpkv.hooks.settings import FLAG
from sglang_cpkv.pd_launch.config import ENV_DEFAULTS
from sglang_cpkv.runtime.reservation import page_rounded

GIB = 2**30
# What the launchers (sglang_cpkv.pd_launch) pass the prefill server by default: the planner sizes that server.
# The memory fraction is an operator's setting for a long-chunk prefill node (upstream's own heuristic is far lower
# at chunk 65536); the DSA backends decide the KV row layout and whether the mode runs (upstream's default prefill
# backend on Blackwell FP8, trtllm, is one the mode refuses).
DEFAULT_MEM_FRACTION = float(ENV_DEFAULTS["PD_PREFILL_MEM_FRACTION_STATIC"])
DEFAULT_PREFILL_BACKEND = ENV_DEFAULTS["PD_DSA_PREFILL_BACKEND"]
DEFAULT_DECODE_BACKEND = ENV_DEFAULTS["PD_DSA_DECODE_BACKEND"]
# Upstream's kv-sharding accepts DSA only on these backends (arg_groups/kv_shard_hook.py).
KV_SHARDING_SERVER = {
    "enable_kv_cache_sharding": True,
    "dsa_prefill_backend": "trtllm",
    "dsa_decode_backend": "trtllm",
}


@dataclass(frozen=True)
class MeasuredLayer:
    """An attention layer the project measured (a record under ``benchmark/results/``), shown beside a matching batch."""

    gpu: str
    cp_size: int
    requests: int
    history: int
    extend: int
    kv: str  # "fp8" (the 656-byte packed rows) or "bf16"
    heads: int
    topk: int
    mode_off_ms: float
    mode_on_ms: float  # the default pipeline at that cp (synchronous at cp 1)
    source: str


# The kit layer (upstream's DSA attention kit, triton_sparse_mla) on one H200, 2026-12-01, issue 17's shape at cp 1.
MEASURED_LAYERS = (
    MeasuredLayer(
        "h200",
        1,
        8,
        8192,
        1024,
        "fp8",
        32,
        2048,
        8.359096050262451,
        8.366924285888672,
        "benchmark/results/2026-12-01-h200-session3/kit-layer/kit_layer_fp8_h32_k2048.json",
    ),
    MeasuredLayer(
        "h200",
        1,
        8,
        8192,
        1024,
        "bf16",
        32,
        2048,
        8.038,
        8.133,
        "benchmark/results/2026-12-01-h200-session3/kit-layer/kit_layer_bf16_h32_k2048.json",
    ),
)


@dataclass(frozen=True)
class PlanInputs:
    """What the operator gives (see the CLI for each)."""

    model_dir: str
    gpu: GpuPreset
    tp_size: int
    cp_sizes: tuple[int, ...]
    weights_bytes_per_gpu: float
    kv_budget_bytes: int | None = None  # per GPU; None: mem_fraction_static x HBM - weights
    mem_fraction_static: float = DEFAULT_MEM_FRACTION
    context_length: int | None = None
    chunked_prefill_size: int = 65536
    max_batch_tokens: int | None = None  # --cp-shared-kv-max-batch-tokens
    kv_cache_dtype: str = "fp8_e4m3"
    prefill_backend: str = DEFAULT_PREFILL_BACKEND  # --dsa-prefill-backend of the mode's and replicated servers
    decode_backend: str = DEFAULT_DECODE_BACKEND  # --dsa-decode-backend (kv-sharding's servers run trtllm for both)
    request_tokens: int = 131072
    batch_requests: int = 8
    batch_history: int = 8192
    batch_extend: int = 1024
    history_sweep: tuple[int, ...] = (2048, 8192, 32768, 131072)
    hicache_ratio: float | None = None  # --hicache-ratio (with --enable-hierarchical-cache)
    hicache_size_gb: float = 0  # --hicache-size (GB of 1e9 bytes per rank; overrides the ratio)
    server_extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hicache(self) -> bool:
        return self.hicache_ratio is not None or self.hicache_size_gb > 0


def _server(inputs: PlanInputs, cp: int, **extra: Any) -> dict[str, Any]:
    base = dict(
        tp_size=inputs.tp_size,
        chunked_prefill_size=inputs.chunked_prefill_size,
        kv_cache_dtype=inputs.kv_cache_dtype,
        dsa_prefill_backend=inputs.prefill_backend,
        dsa_decode_backend=inputs.decode_backend,
        **inputs.server_extra,
    )
    if inputs.context_length is not None:
        base["context_length"] = inputs.context_length
    base["mem_fraction_static"] = inputs.mem_fraction_static
    if cp == 1:
        base.update(enable_prefill_cp=False, cp_strategy=None)
    else:
        base["attn_cp_size"] = cp
    return prefill_cp_server(inputs.model_dir, **{**base, **extra})


def _node_figures(node: NodeCapacity, request_tokens: int) -> dict[str, Any]:
    need = page_rounded(request_tokens, node.page_size)
    return {
        "kv_tokens": node.node_tokens,
        "pool_tokens_per_rank": node.pool_tokens,
        "allocator": node.allocator,
        "widening": node.widening,
        "cell_bytes": node.cell_bytes,
        "overhead_gib": node.fixed_overhead_bytes / GIB,
        "longest_context": min(node.context_len, node.node_tokens),
        "concurrent_requests": node.node_tokens // need,
    }


def host_tier(node: NodeCapacity, layers: int, ratio: float | None, size_gb: float) -> dict[str, Any]:
    """The HiCache host pool of one rank as upstream's ``HostKVCache`` sizes it: ``--hicache-size`` GB over the KV host
    pool's bytes a token (the latent row of every layer), else ``--hicache-ratio`` x the rank's pool tokens, then one
    padding page; the indexer's host pool holds the same pages' index K. Under the mode each rank's host pool holds
    the pages it owns (``hooks/hicache.py``), so the node caches ``cp`` x a rank's tokens; a replicated node holds
    every page on every rank."""
    kv_token_bytes = node.latent_token_bytes * layers
    if size_gb > 0:
        tokens = int(size_gb * 1e9 // kv_token_bytes)
    else:
        tokens = int(node.pool_tokens * ratio)
    tokens = (tokens // node.page_size + 1) * node.page_size
    return {
        "host_tokens_per_rank": tokens,
        "host_gib_per_rank": tokens * (node.latent_token_bytes + node.index_k_token_bytes) * layers / GIB,
        "host_tokens_node": tokens * node.widening,  # the allocator's widening: cp pools of page ids, or one
    }


def plan(inputs: PlanInputs, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One dict per cp (the JSON's objects); ``progress`` gets a line per server sized."""
    say = progress or (lambda line: None)
    rows = []
    with playing_gpu(inputs.gpu.capability, hbm_bytes=inputs.gpu.hbm_bytes):
        for cp in inputs.cp_sizes:
            if inputs.kv_budget_bytes is not None:
                budget, fraction = inputs.kv_budget_bytes, None
            else:
                fraction = inputs.mem_fraction_static
                budget = int(fraction * inputs.gpu.hbm_bytes - inputs.weights_bytes_per_gpu)
                if budget <= 0:
                    raise ValueError(
                        f"--mem-fraction-static {fraction:.3f} of {inputs.gpu.hbm_bytes / 1e9:.0f} GB leaves no KV "
                        f"budget after {inputs.weights_bytes_per_gpu / GIB:.1f} GiB of weights per GPU "
                        "(--weights-gib, --tp): give --kv-budget-gib"
                    )
            extra = {}
            if inputs.max_batch_tokens is not None:
                extra["cp_shared_kv_max_batch_tokens"] = inputs.max_batch_tokens
            say(f"cp {cp}: sizing the replicated server")
            replicated = size_node(_server(inputs, cp), layers=_layers(inputs), budget_bytes=budget)
            row: dict[str, Any] = {
                "cp": cp,
                "attn_tp": replicated.attn_tp_size,
                "kv_budget_gib": budget / GIB,
                "mem_fraction_static": fraction,
                "upstream_mem_fraction_static": upstream_mem_fraction(_server(inputs, cp)),
                "mode_runs": cp > 1,
            }
            mode, sharded = replicated, None
            if cp > 1:
                say(f"cp {cp}: sizing the mode's server (--enable-cp-shared-kv)")
                try:
                    mode = size_node(
                        _server(inputs, cp, enable_cp_shared_kv=True, **extra),
                        layers=_layers(inputs),
                        budget_bytes=budget,
                    )
                except ValueError as refusal:
                    # The server refuses the mode here at start-up (the compatibility table): reported, not sized.
                    if not str(refusal).startswith(FLAG):
                        raise
                    row["mode_runs"], row["mode_refused"] = False, str(refusal)
                say(f"cp {cp}: sizing upstream's kv-sharding server")
                sharded = size_node(
                    _server(inputs, cp, **KV_SHARDING_SERVER), layers=_layers(inputs), budget_bytes=budget
                )
            figures = _node_figures(mode, inputs.request_tokens)
            row.update(figures)
            row["kv_tokens_replicated"] = replicated.node_tokens
            row["ratio"] = mode.node_tokens / replicated.node_tokens
            row["replicated"] = _node_figures(replicated, inputs.request_tokens)
            row["kv_tokens_kv_sharding"] = None if sharded is None else sharded.node_tokens
            row["ratio_kv_sharding"] = None if sharded is None else sharded.node_tokens / replicated.node_tokens
            row["kv_sharding"] = None if sharded is None else _node_figures(sharded, inputs.request_tokens)
            if inputs.hicache:
                args = (_layers(inputs), inputs.hicache_ratio, inputs.hicache_size_gb)
                row["host"] = host_tier(mode, *args) if row["mode_runs"] else None
                row["replicated"]["host"] = host_tier(replicated, *args)
            reservation = mode.reservation
            row["kv_tokens_at_sharding_cell"] = None
            if sharded is not None and reservation is not None:
                row["kv_tokens_at_sharding_cell"] = mode_tokens_at_cell(mode, sharded, budget)
                row["ratio_at_sharding_cell"] = row["kv_tokens_at_sharding_cell"] / replicated.node_tokens
            row["reservation"] = (
                None
                if reservation is None
                else {
                    "gib": reservation.total_bytes / GIB,
                    "bytes": reservation.total_bytes,
                    "max_batch_tokens": reservation.max_batch_tokens,
                    "dense_slots": reservation.dense_slots,
                    "percent_of_budget": 100 * reservation.total_bytes / budget,
                    "parts_mib": {k: v / 2**20 for k, v in reservation.parts().items()},
                }
            )
            if reservation is not None:
                row["requests_per_batch"] = reservation.max_batch_tokens // page_rounded(
                    inputs.request_tokens, mode.page_size
                )
            say(f"cp {cp}: per-layer traffic of the batch and the history sweep")
            row["layer"] = _layer_figures(inputs, cp, mode, reservation)
            rows.append(row)
    return rows


def pool_tokens(budget: int, overhead: int, cell_bytes: int, page_size: int) -> int:
    """Tokens of a rank's pool as upstream's configurator sizes it: the budget less its fixed overhead, in whole
    pages of ``cell_bytes`` per token (``kv_cache_configurator``'s ``config_from_budget``)."""
    return max(0, budget - overhead) // cell_bytes // page_size * page_size


def mode_tokens_at_cell(mode: NodeCapacity, sharded: NodeCapacity, budget: int) -> int:
    """The mode's node at kv-sharding's KV cell (module docstring): its reservation with the latent row kv-sharding's
    layout has, the pool sized as upstream sizes one, cp pools."""
    from dataclasses import replace

    reservation = replace(mode.reservation, latent_token_bytes=sharded.latent_token_bytes)
    tokens = pool_tokens(budget, reservation.total_bytes, sharded.cell_bytes, mode.page_size)
    return mode.widening * tokens


def _layers(inputs: PlanInputs) -> int:
    import json
    from pathlib import Path

    return int(json.loads(Path(inputs.model_dir, "config.json").read_text())["num_hidden_layers"])


def _traffic_row(traffic: LayerTraffic, gpu: GpuPreset) -> dict[str, Any]:
    return {**asdict(traffic), **traffic.times(gpu.hbm_bandwidth, gpu.link_bandwidth)}


def _layer_figures(inputs: PlanInputs, cp: int, node: NodeCapacity, reservation) -> dict[str, Any]:
    latent, index_k = node.latent_token_bytes, node.index_k_token_bytes

    def traffic(history: int) -> LayerTraffic:
        return layer_traffic(
            [history] * inputs.batch_requests,
            [inputs.batch_extend] * inputs.batch_requests,
            page_size=node.page_size,
            cp_size=cp,
            latent_token_bytes=latent,
            index_k_token_bytes=index_k,
        )

    batch_traffic = traffic(inputs.batch_history)
    batch = _traffic_row(batch_traffic, inputs.gpu)
    past_reservation = None
    if reservation is not None:
        from sglang_cpkv.ops.errors import CpSharedKvError

        try:
            reservation.check_batch(
                batch_traffic.needed_rows,
                batch_traffic.num_slots,
                batch_traffic.num_tokens,
                batch_traffic.entries,
            )
        except CpSharedKvError as refusal:  # a server would refuse the batch: no time is shown for it
            past_reservation = str(refusal)
    kv = "fp8" if inputs.kv_cache_dtype.startswith("fp8") else "bf16"
    measured = [
        asdict(m)
        for m in MEASURED_LAYERS
        if (m.gpu, m.cp_size, m.requests, m.history, m.extend, m.kv)
        == (inputs.gpu.name, cp, inputs.batch_requests, inputs.batch_history, inputs.batch_extend, kv)
    ]
    return {
        "batch": {
            "requests": inputs.batch_requests,
            "history": inputs.batch_history,
            "extend": inputs.batch_extend,
        },
        "latent_token_bytes": latent,
        "index_k_token_bytes": index_k,
        "past_reservation": past_reservation,
        **batch,
        "measured_layer": measured[0] if measured else None,
        "sweep": [{"history": h, **_traffic_row(traffic(h), inputs.gpu)} for h in inputs.history_sweep],
    }


def stderr_progress(line: str) -> None:
    print(f"[capacity] {line}", file=sys.stderr, flush=True)


def cp_list(text: str) -> tuple[int, ...]:
    """``--cp 1,2,4,8`` -> (1, 2, 4, 8); refuses anything but positive integers."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--cp: a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--cp: every value must be >= 1, got {text!r}")
    return values


# Upstream's DSA prefill CP runs on one node (model_overrides/deepseek_v2.py asserts tp_size <= 8).
MAX_CP_TP = 8
# The batch the per-layer figures plan (runtime/plan.build_plan on the host): bounded so that a typo cannot ask for
# terabytes of plan.
MAX_BATCH_ENTRIES = 4_000_000
PAGE_SIZE = 64  # the DSA page size the mode runs with


def check_model(model_dir: str) -> None:
    """A ``config.json`` the planner can size: a JSON object of a DSA model (``index_topk``) with its layer count."""
    import json
    from pathlib import Path

    path = Path(model_dir, "config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable JSON config ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config.json is a JSON object, got {type(config).__name__}")
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    if "index_topk" not in text:
        architectures = text.get("architectures") or config.get("architectures") or ["(none)"]
        raise ValueError(
            f"{path}: not a DSA model (no index_topk; architectures {architectures}): the mode serves DSA models "
            "(DeepSeek-V3.2, GLM-5.x)"
        )
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{path}: num_hidden_layers must be a positive integer, got {layers!r}")


def check_inputs(inputs: PlanInputs) -> None:
    """Refuse what upstream would refuse less clearly, naming the option."""
    if inputs.tp_size > MAX_CP_TP:
        raise ValueError(
            f"--tp {inputs.tp_size}: upstream's DSA prefill CP runs on one node (it asserts tp_size <= {MAX_CP_TP})"
        )
    for cp in inputs.cp_sizes:
        if inputs.tp_size % cp:
            raise ValueError(f"--cp {cp}: must divide --tp {inputs.tp_size}")
    if inputs.kv_budget_bytes is not None and inputs.kv_budget_bytes <= 0:
        raise ValueError("--kv-budget-gib must be > 0")
    if inputs.kv_budget_bytes is not None and inputs.kv_budget_bytes > inputs.gpu.hbm_bytes:
        raise ValueError(
            f"--kv-budget-gib {inputs.kv_budget_bytes / GIB:.1f}: more than the GPU's HBM "
            f"({inputs.gpu.hbm_bytes / GIB:.1f} GiB, --gpu {inputs.gpu.name} or --hbm-gb)"
        )
    if not math.isfinite(inputs.weights_bytes_per_gpu) or inputs.weights_bytes_per_gpu < 0:
        raise ValueError(f"--weights-gib must be >= 0, got {inputs.weights_bytes_per_gpu / GIB}")
    if inputs.context_length is not None and inputs.context_length < 1:
        raise ValueError(f"--context-length must be >= 1, got {inputs.context_length}")
    if inputs.max_batch_tokens is not None and inputs.max_batch_tokens < 1:
        raise ValueError(f"--cp-shared-kv-max-batch-tokens must be >= 1, got {inputs.max_batch_tokens}")
    if not 0 < inputs.mem_fraction_static <= 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1], got {inputs.mem_fraction_static}")
    if inputs.hicache_ratio is not None and not (math.isfinite(inputs.hicache_ratio) and inputs.hicache_ratio > 0):
        raise ValueError(f"--hicache-ratio must be a finite number > 0, got {inputs.hicache_ratio}")
    if not (math.isfinite(inputs.hicache_size_gb) and inputs.hicache_size_gb >= 0):
        raise ValueError(f"--hicache-size must be a finite number >= 0, got {inputs.hicache_size_gb}")
    for name in ("chunked_prefill_size", "request_tokens", "batch_requests", "batch_extend"):
        if getattr(inputs, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(inputs, name)}")
    if inputs.batch_history < 0 or any(h < 0 for h in inputs.history_sweep):
        raise ValueError("--batch-history and --history-sweep must be >= 0")
    for history in (inputs.batch_history, *inputs.history_sweep):
        entries = inputs.batch_requests * -(-(history + inputs.batch_extend) // PAGE_SIZE)
        if entries > MAX_BATCH_ENTRIES:
            raise ValueError(
                f"the batch of --batch-requests {inputs.batch_requests} x ({history} history + {inputs.batch_extend} "
                f"current tokens) has {entries:,} page-table entries; the planner builds its plan, up to "
                f"{MAX_BATCH_ENTRIES:,}"
            )
