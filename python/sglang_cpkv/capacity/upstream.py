"""Upstream's own server resolution and KV pool sizing, on any machine (what a prefill server does at start-up).

:func:`size_node` resolves a real ``ServerArgs`` and publishes it as a scheduler does (inside
:func:`scoped_runtime_context`: nothing is left in upstream's process-wide context), turns a KV budget into a pool
with upstream's ``KVCacheConfigurator`` (``DefaultPoolConfigurator``, patched to charge the mode's reservation) and
builds the allocator upstream builds for it; a node's capacity is what ``TpModelWorker.get_worker_info`` reports.
:func:`playing_gpu` makes the CUDA capability answer for the GPU the sizing plays. Needs the pinned upstream. Used
by :mod:`.planner`, the launcher's dry-run, the soak and the reservation tests; ``docs/operations.md``, "The
capacity planner".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sglang_cpkv.envs import environment, envs
from sglang_cpkv.runtime.reservation import Reservation

# The prefill server of the mode needs all-CP-ranks KV transfer (README, Settings); the draft's extend under CP.
MODE_ENV = {envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.name: "1", envs.SGLANG_CPKV_DRAFT_SHARED_KV.name: "1"}
# Set for the rest of the process by a resolution (upstream's kv-sharding, arg_groups/kv_shard_hook.py, and the
# mode's, hooks/server_args.py): put back by scoped_runtime_context.
RESOLUTION_SETS_ENV = (envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.name,)


@contextlib.contextmanager
def scoped_runtime_context() -> Iterator[None]:
    """Upstream's process-wide runtime context (published server args, config bags, parallel overrides and
    stamps, flags, resources, the environment a resolution sets: :data:`RESOLUTION_SETS_ENV`) as it was before the
    block, restored after it: a published ``ServerArgs`` of one sizing or test never leaks into the next (a TP 8
    server left published makes a later CP 2 world's parallel topology inconsistent)."""
    from sglang.srt import runtime_context

    context = runtime_context.get_context()
    parallel = context.parallel
    saved = (
        context._server_args,
        context._config_bags,
        list(context._overrides_log),
        context._publish_role,
        context.flags,
        context.resources,
        context.forward,
        parallel._config,
        dict(parallel._stamp),
        dict(parallel._overrides),
    )
    try:
        with environment(keep=RESOLUTION_SETS_ENV):
            yield
    finally:
        (
            context._server_args,
            context._config_bags,
            context._overrides_log,
            context._publish_role,
            context.flags,
            context.resources,
            context.forward,
            parallel._config,
            stamp,
            overrides,
        ) = saved
        parallel._stamp.clear()
        parallel._stamp.update(stamp)
        parallel._overrides.clear()
        parallel._overrides.update(overrides)


@contextlib.contextmanager
def seeing_gpu_memory(hbm_bytes: float | None) -> Iterator[None]:
    """For the block only: upstream's server-args resolution sees a GPU of ``hbm_bytes`` (its memory defaults:
    ``mem_fraction_static``, chunk size, graph sizes); None changes nothing (the machine's GPU, or none)."""
    from sglang.srt.arg_groups import kv_shard_hook, memory_hook

    hooks = (memory_hook, kv_shard_hook)
    saved_memory = [hook.get_device_memory_capacity for hook in hooks]
    if hbm_bytes is not None:
        for hook in hooks:
            hook.get_device_memory_capacity = lambda device=None: hbm_bytes / 2**20  # MiB, as upstream's query
    try:
        yield
    finally:
        for hook, saved in zip(hooks, saved_memory):
            hook.get_device_memory_capacity = saved


@contextlib.contextmanager
def playing_gpu(capability: tuple[int, int], *, hbm_bytes: float | None = None, quiet: bool = True) -> Iterator[None]:
    """For the block only: ``torch.cuda.get_device_capability`` answers ``capability``, upstream's server-args
    resolution sees a GPU of ``hbm_bytes`` (:func:`seeing_gpu_memory`; None: no GPU memory known, upstream's
    CPU-side defaults), :data:`MODE_ENV` is set; with ``quiet`` upstream's resolution logs (several warnings per
    server) are held below ERROR."""
    saved_capability = torch.cuda.get_device_capability
    sglang_logger = logging.getLogger("sglang")
    saved_level = sglang_logger.level
    torch.cuda.get_device_capability = lambda *a, **k: capability
    if quiet:
        sglang_logger.setLevel(logging.ERROR)
    try:
        with seeing_gpu_memory(hbm_bytes), environment(MODE_ENV):
            yield
    finally:
        torch.cuda.get_device_capability = saved_capability
        sglang_logger.setLevel(saved_level)


def prefill_cp_server(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """``ServerArgs`` keywords of a P/D prefill server with DSA prefill CP (TP 8 and, unless ``attn_cp_size`` says
    otherwise, CP 8; interleave, Mooncake): the server the reservation tests, benchmark and planner size
    (``overrides`` win)."""
    return {
        "model_path": model_dir,
        "skip_tokenizer_init": True,
        "device": "cuda",
        "tp_size": 8,
        "enable_prefill_cp": True,
        "cp_strategy": "interleave",
        "disaggregation_mode": "prefill",
        "disaggregation_transfer_backend": "mooncake",
        **overrides,
    }


def resolve_and_publish(server: dict[str, Any]):
    """``ServerArgs(**server)`` resolved and published in upstream's runtime context (the caller scopes it)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(**server)
    args.resolve_once()
    runtime_context.get_context().set_server_args(args)
    return args


def upstream_mem_fraction(server: dict[str, Any]) -> float:
    """The ``mem_fraction_static`` upstream resolves for ``server`` when the operator gives none (its heuristic for
    this GPU's memory, chunk and parallelism; call inside :func:`playing_gpu` with the GPU's HBM)."""
    with scoped_runtime_context():
        return float(
            resolve_and_publish({**server, "mem_fraction_static": None}).resolved_dict()["mem_fraction_static"]
        )


def kv_cache_configurator(args: Any, *, layers: int, page_size: int, draft_worker: bool = False):
    """Upstream's ``KVCacheConfigurator`` of a model runner of the published ``args`` with ``layers`` layers of KV."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    fp8 = str(args.kv_cache_dtype).startswith("fp8")
    return KVCacheConfigurator(
        device="cuda",
        gpu_id=0,
        attn_dp_size=1,
        pp_size=1,
        pp_group=None,
        model=None,
        model_config=ModelConfig.from_server_args(args),
        server_args=args,
        kv_cache_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
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


def pool_configurator(server: dict[str, Any], *, layers: int, page_size: int, draft_worker: bool = False):
    """``(server_args, DefaultPoolConfigurator)`` for ``ServerArgs(**server)`` with ``layers`` layers of KV, its
    args published (the caller scopes it: :func:`scoped_runtime_context`)."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    args = resolve_and_publish(server)
    return args, DefaultPoolConfigurator(
        kv_cache_configurator(args, layers=layers, page_size=page_size, draft_worker=draft_worker)
    )


def token_allocator(kvc: Any, sizes: Any, pool: Any = None) -> Any:
    """The token allocator upstream's (patched) configurator ``kvc`` builds for pool ``sizes``, on the CPU (its free
    lists only; the branch it takes does not read the device), over ``pool`` (None: no pool object)."""
    kvc.device = "cpu"
    return kvc._build_token_to_kv_pool_allocator(
        sizes=sizes,
        token_to_kv_pool=pool,
        is_dsv4_model=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
    )


class _StandInGroup:
    """The attention-CP group handle of rank 0 of ``world_size`` ranks, for a sizing with no process group: all
    upstream's kv-sharding sizing reads of it are its width and this rank (``get_kv_shard_group_info``)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank_in_group = 0


@dataclass(frozen=True)
class NodeCapacity:
    """One server's KV capacity as upstream sizes it.

    Attributes:
        pool_tokens: rows of each rank's KV pool (upstream's ``max_total_num_tokens``).
        node_tokens: tokens the scheduler admits against (``get_worker_info``'s ``kv_capacity``): distinct KV
            tokens the node holds.
        allocator: the class of the token allocator upstream builds for the pool.
        widening: its page-interleave widening (``page_interleave_shard_size``).
        cell_bytes: bytes of one token over all layers (the configurator's cell size).
        fixed_overhead_bytes: what the configurator charged before sizing (kv-sharding scratch, the mode's
            reservation).
        reservation: the mode's reservation the patched configurator published (None with the mode off).
        latent_token_bytes, index_k_token_bytes: one token's row of the latent pool and of the index-K pool, as
            the reservation hook reads them (``hooks/reservation.py``).
        attn_cp_size, attn_tp_size, chunk_tokens, context_len, page_size: as resolved.
    """

    pool_tokens: int
    node_tokens: int
    allocator: str
    widening: int
    cell_bytes: int
    fixed_overhead_bytes: int
    reservation: Reservation | None
    latent_token_bytes: int
    index_k_token_bytes: int
    attn_cp_size: int
    attn_tp_size: int
    chunk_tokens: int
    context_len: int
    page_size: int


def size_node(server: dict[str, Any], *, layers: int, budget_bytes: int) -> NodeCapacity:
    """Upstream's pool and allocator for ``ServerArgs(**server)`` given ``budget_bytes`` of KV budget per rank.

    Runs inside :func:`scoped_runtime_context` and a process state of its own (``hooks/state.py``): the mode's
    configuration and allocator record the sizing publishes are put back afterwards.
    A kv-sharding server (``enable_kv_cache_sharding``) sizes as rank 0 of its attention-CP group.
    """
    from sglang_cpkv.hooks import state

    with scoped_runtime_context(), state.scoped() as process:
        return _size_published(resolve_and_publish(server), process, layers=layers, budget_bytes=budget_bytes)


def _size_published(args: Any, process: Any, *, layers: int, budget_bytes: int) -> NodeCapacity:
    """:func:`size_node` of the published, resolved ``args`` (the caller scopes the context and the process state)."""
    from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_parallel, get_schedule

    from sglang_cpkv.hooks import reservation as reservation_hooks

    with contextlib.ExitStack() as stack:
        parallel = get_parallel()
        if getattr(args, "enable_kv_cache_sharding", False):
            stack.enter_context(parallel.override(attn_cp_group=_StandInGroup(parallel.attn_cp_size), attn_cp_rank=0))
        page_size = get_schedule().page_size
        kvc = kv_cache_configurator(args, layers=layers, page_size=page_size)
        config = kvc.config_from_budget(budget_bytes)
        # The configurator the budget went through (the patched one charges the reservation when it is made).
        configurator = create_memory_pool_configurator(kvc)
        sizes = kvc._derive_pool_sizes(config=config)
        allocator = token_allocator(kvc, sizes)
        widening = page_interleave_shard_size(allocator)
        return NodeCapacity(
            pool_tokens=sizes.max_total_num_tokens,
            node_tokens=kvc.logical_token_capacity(max_total_num_tokens=sizes.max_total_num_tokens) * widening,
            allocator=type(allocator).__name__,
            widening=widening,
            cell_bytes=configurator._cell_size,
            fixed_overhead_bytes=configurator._fixed_overhead_bytes,
            reservation=None if process.config is None else process.config.reservation,
            latent_token_bytes=calculate_mla_kv_cache_dim(
                model_config=kvc.model_config, kv_cache_dtype=kvc.kv_cache_dtype
            )
            * torch._utils._element_size(kvc.kv_cache_dtype),
            index_k_token_bytes=reservation_hooks.index_k_token_bytes(kvc.model_config.hf_config),
            attn_cp_size=parallel.attn_cp_size,
            attn_tp_size=parallel.attn_tp_size,
            chunk_tokens=get_schedule().chunked_prefill_size,
            context_len=kvc.model_config.context_len,
            page_size=page_size,
        )


@dataclass(frozen=True)
class KvBudget:
    """What one GPU of a server keeps for its KV pool, and the pool upstream sizes from it.

    Attributes:
        hbm_bytes: the GPU's memory. mem_fraction_static: the server's, as resolved (given or upstream's default).
        weights_bytes: a lower bound on the weights one GPU holds (:mod:`.weights`).
        budget_bytes: ``mem_fraction_static x hbm_bytes - weights_bytes``: an upper bound on the KV budget (upstream
            also charges the CUDA context and the communication buffers to it); <= 0: none.
        node_tokens: the KV tokens the server admits against (a rank's pool, cp pools under the mode), 0 when the
            budget holds no pool. context_len, page_size, kv_cache_dtype: as resolved.
    """

    hbm_bytes: float
    mem_fraction_static: float
    weights_bytes: int
    budget_bytes: int
    node_tokens: int
    context_len: int
    page_size: int
    kv_cache_dtype: str

    @property
    def holds_one_request(self) -> bool:
        """Whether one request of the context length fits (page-rounded, as the allocator takes it)."""
        return self.node_tokens >= -(-self.context_len // self.page_size) * self.page_size


def kv_budget(args: Any, *, hbm_bytes: float) -> KvBudget | None:
    """The KV budget and pool of one GPU of the server of the resolved ``args`` on a GPU of ``hbm_bytes`` (call with
    the server's environment, inside :func:`seeing_gpu_memory` when the resolution played that GPU); None when the
    weights cannot be bounded from the model's config (:mod:`.weights`)."""
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_parallel, get_schedule

    from sglang_cpkv.capacity.weights import weight_bytes_per_gpu_lower_bound
    from sglang_cpkv.hooks import state

    with scoped_runtime_context(), state.scoped() as process:
        runtime_context.get_context().set_server_args(args)
        parallel = get_parallel()
        model_config = ModelConfig.from_server_args(args)
        weights = weight_bytes_per_gpu_lower_bound(
            model_config.hf_config, tp_size=parallel.tp_size, attn_tp_size=parallel.attn_tp_size
        )
        if weights is None:
            return None
        resolved = args.resolved_dict()
        fraction = float(resolved["mem_fraction_static"])
        budget = int(fraction * hbm_bytes - weights)
        node_tokens = 0
        if budget > 0:
            try:
                node_tokens = _size_published(
                    args, process, layers=model_config.num_hidden_layers, budget_bytes=budget
                ).node_tokens
            except (RuntimeError, ValueError):  # upstream's "Not enough memory": the budget holds no pool
                node_tokens = 0
        return KvBudget(
            hbm_bytes=hbm_bytes,
            mem_fraction_static=fraction,
            weights_bytes=weights,
            budget_bytes=budget,
            node_tokens=node_tokens,
            context_len=model_config.context_len,
            page_size=get_schedule().page_size,
            kv_cache_dtype=str(resolved["kv_cache_dtype"]),
        )
