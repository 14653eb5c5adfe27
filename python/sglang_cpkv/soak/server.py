"""A P/D prefill or decode server of the soak, made of upstream's objects, in one process per rank.

What a server process does at start-up, by upstream's own code where it runs without a GPU or a model:
:func:`server_argv` / :func:`start_process` (the command line, ``ServerArgs`` resolution and ``publish``, gloo groups
through the patched ``initialize_model_parallel``, the Mooncake engine), :func:`build_pools` (the patched
``KVCacheConfigurator.configure`` on the CPU for a KV budget) and :func:`build_scheduler` (a ``Scheduler`` made
without ``__init__``: upstream's ``init_*`` methods in the order of :data:`INIT_STEPS`, held to
``Scheduler.__init__`` by a test, and ``build_kv_cache``). Used by :mod:`.cli`, :mod:`.prefill` and :mod:`.decode`;
the stand-in model is :mod:`.model`. Design: ``docs/design/cp-shared-kv-soak.md``, "What runs".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sglang_cpkv.envs import envs as cpkv_envs
from sglang_cpkv.soak import cpu_kernels
from sglang_cpkv.testing.dsa_kit import DSA_CONFIG

logger = logging.getLogger(__name__)

LAYERS = 2  # the stand-in model's layers of KV
HEADS = 4
# What every soak process runs with: TCP on loopback, the mode's all-CP-ranks transfer, P/D timeouts past the soak's own
# (a CPU prefill is slow: its requests wait longer than a GPU server's), clean shutdown of the KV managers.
PROCESS_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "MOONCAKE_PROTOCOL": "tcp",
    cpkv_envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.name: "1",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1800",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1800",
    "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
    "SGLANG_OPT_USE_TOPK_V2": "0",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
}


@dataclass(frozen=True)
class ServerConfig:
    """One soak scenario's servers (recorded in the report)."""

    cp: int = 1
    mode_on: bool = True
    chunked_prefill_size: int = 256
    radix_cache: bool = True
    hicache: bool = False
    fp8: bool = False
    prefill_backend: str = "flashmla_sparse"
    fused_topk: bool = True
    kv_budget_mib: float = 20.0  # per prefill rank: the reservation (about 6 MiB), then the pool
    decode_kv_budget_mib: float = 64.0
    max_running_requests: int = 8
    context_length: int = 4096
    max_batch_tokens: int | None = None  # --cp-shared-kv-max-batch-tokens (None: the default)
    overlap: bool = False
    topk: int = 32
    # "mooncake": the decode server and the real transfer engine; "fake": no decode, every request on upstream's fake
    # bootstrap host (its fake sender), the Mooncake KV manager over an engine stand-in that moves nothing (the GPU
    # soak: the engine's CUDA build cannot be installed on the GPU machines; the CPU soak proves the transfer)
    transfer_backend: str = "mooncake"

    @property
    def kv_cache_dtype(self) -> str:
        return "fp8_e4m3" if self.fp8 else "auto"

    def describe(self) -> dict:
        return asdict(self)


def write_model_dir(directory: Path) -> str:
    """A DSA ``config.json`` (DeepSeek-V3.2's, with the stand-in model's layers) as the servers' model path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps(dict(DSA_CONFIG, num_hidden_layers=LAYERS, first_k_dense_replace=1))
    )
    return str(directory)


def server_argv(config: ServerConfig, role: str, model_dir: str, bootstrap_port: int) -> list[str]:
    """The server's command line (``role``: ``prefill`` or ``decode``)."""
    argv = [
        "--model-path", model_dir,
        "--skip-tokenizer-init",
        "--device", "cuda",  # resolved as a GPU server; the pools and the stand-in model are on this process's device
        "--host", "127.0.0.1",
        "--random-seed", "1",
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--kv-cache-dtype", config.kv_cache_dtype,
        "--context-length", str(config.context_length),
    ]  # fmt: skip
    if role == "decode":
        return argv + ["--max-running-requests", "64"]
    argv += [
        "--dsa-prefill-backend", config.prefill_backend,
        "--chunked-prefill-size", str(config.chunked_prefill_size),
        "--max-running-requests", str(config.max_running_requests),
    ]  # fmt: skip
    if config.cp > 1:
        argv += ["--tp", str(config.cp), "--enable-prefill-cp", "--cp-strategy", "interleave"]
        if config.mode_on:
            argv.append("--enable-cp-shared-kv")
            if config.max_batch_tokens is not None:
                argv += ["--cp-shared-kv-max-batch-tokens", str(config.max_batch_tokens)]
    if not config.radix_cache:
        argv.append("--disable-radix-cache")
    if not config.overlap:
        argv.append("--disable-overlap-schedule")
    if config.hicache:
        argv += [
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "kernel",
            "--hicache-mem-layout", "page_first", "--hicache-write-policy", "write_through",
        ]  # fmt: skip
    return argv


def start_process(config: ServerConfig, role: str, rank: int, model_dir: str, bootstrap_port: int, init_method: str):
    """Resolve and publish this process's server args as a scheduler process does, make upstream's process groups
    over gloo (one rank at cp 1, and the decode) and the process's Mooncake engine. Returns the resolved args.

    At cp 1 the mode's flag is set after the resolution: a server refuses the mode without prefill CP
    (``hooks/server_args.py``), and the soak's cp 1 runs the mode's machinery on one rank as the kit's cp 1 tests do,
    with the radix tree core the mode's resolution selects (the Python one)."""
    os.environ.update(PROCESS_ENV)
    if role == "prefill" and config.cp == 1 and config.mode_on:
        cpkv_envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.set("python")
    from sglang_cpkv.testing import dsa_kit

    dsa_kit._upstream()  # torchvision stub, the device capability of a Hopper GPU
    if config.transfer_backend == "mooncake":
        require_transfer_engine()
    else:
        sys.modules["mooncake"] = sys.modules["mooncake.engine"] = _standin_mooncake()
    import msgspec
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    dsa_kit._upstream()["kit"]._parallel_override.__exit__(None, None, None)  # the kit pins cp 1 at its import
    if cpkv_envs.TRITON_INTERPRET.get():
        cpu_kernels.install()
    if not torch.cuda.is_available():
        torch.cuda.Event = _CpuEvent  # the overlap scheduler's prefill path makes CUDA events by name; a CPU has none
    args = prepare_server_args(server_argv(config, role, model_dir, bootstrap_port))
    args.resolve_once()
    if role == "prefill" and config.cp == 1 and config.mode_on:
        msgspec.Struct.__setattr__(args, "enable_cp_shared_kv", True)
    # The KV managers' receive threads poll instead of blocking, so that a soak process can stop them (upstream's
    # role-switch servers run them so; nothing else of the field is read on these paths).
    msgspec.Struct.__setattr__(args, "enable_pd_role_switch", True)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    world = config.cp if role == "prefill" else 1
    parallel_state.init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=init_method, local_rank=0, backend="gloo"
    )
    parallel_state.initialize_model_parallel()
    init_mooncake_transfer_engine("127.0.0.1", gpu_id=0, ib_device=None)
    return args


class _StandInTransferEngine:
    """TEST-ONLY, the fake transfer (``ServerConfig.transfer_backend``): the engine of a KV manager that is built but
    never used (every request goes to upstream's fake sender). Moving bytes raises."""

    def initialize(self, *args: Any) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 0

    def register_memory(self, *args: Any) -> int:
        return 0

    unregister_memory = batch_register_memory = batch_unregister_memory = register_memory

    def get_engine(self) -> Any:
        return self

    def transfer_sync_write(self, *args: Any) -> int:
        raise RuntimeError("the soak's fake transfer moves nothing: a request reached the Mooncake engine")

    batch_transfer_sync_write = send_probe = transfer_sync_write


def _standin_mooncake() -> types.ModuleType:
    """``mooncake.engine`` for the fake transfer: a module whose ``TransferEngine`` is :class:`_StandInTransferEngine`."""
    module = types.ModuleType("mooncake.engine", "TEST-ONLY stand-in of Mooncake's engine (the soak's fake transfer)")
    module.TransferEngine = _StandInTransferEngine
    return module


def stop_kv_manager(disagg_queue: Any) -> None:
    """Stop the KV manager of a scheduler's disaggregation queue (its threads and sockets), after the report."""
    manager = getattr(disagg_queue, "kv_manager", None)
    if manager is None:
        return
    try:
        manager.teardown()
    except Exception:
        logger.exception("KV manager teardown")


def require_transfer_engine() -> None:
    """Mooncake's transfer engine and what upstream's KV manager imports beside it, or an error naming the package."""
    import importlib.util

    if importlib.util.find_spec("prometheus_client") is None:
        raise RuntimeError("the soak needs prometheus-client (upstream's requirement): pip install prometheus-client")
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise RuntimeError(
                f"Mooncake's transfer engine needs the system package libibverbs1 (apt-get install libibverbs1): {exc}"
            ) from exc
        raise RuntimeError(
            "the soak needs Mooncake's transfer engine: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
            f"(requirements/dev-cpu.txt; upstream's image ships its CUDA build): {exc}"
        ) from exc


@dataclass
class Pools:
    """Upstream's pools for one rank, as its configurator built them."""

    req_to_token_pool: Any
    token_to_kv_pool: Any
    allocator: Any
    max_total_num_tokens: int
    max_running_requests: int


def build_pools(args: Any, budget_mib: float, device: str) -> Pools:
    """Upstream's ``KVCacheConfigurator.configure`` for ``budget_mib`` of KV on ``device`` (its memory profile is the
    one step stood in: the budget is given)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.runtime_context import get_schedule

    from sglang_cpkv.capacity.upstream import kv_cache_configurator

    kvc = kv_cache_configurator(args, layers=LAYERS, page_size=get_schedule().page_size)
    kvc.device = device
    budget = int(budget_mib * 2**20)
    with _patched(KVCacheConfigurator, "_profile_available_bytes", lambda self, pre: budget):
        result = kvc.configure(pre_model_load_memory=0)
    return Pools(
        result.req_to_token_pool,
        result.token_to_kv_pool,
        result.token_to_kv_pool_allocator,
        result.max_total_num_tokens,
        result.max_running_requests,
    )


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


class SoakWorker:
    """What upstream's scheduler and cache builder read of a model worker (``BaseTpWorker``'s surface), for the soak's
    stand-in workers: their runner (``model_runner``), pools and HiCache consumer hooks."""

    random_seed, dllm_algorithm, model_runner_list = 1, None, None
    hicache_layer_transfer_counter = None

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self.model_config, self.device = runner.model_config, runner.device

    @property
    def model_runner(self) -> Any:
        return self._runner

    @property
    def is_hybrid_swa(self) -> bool:
        return False

    @property
    def last_shared_read_runner(self) -> Any:
        return self._runner

    def get_memory_pool(self):
        return self._runner.req_to_token_pool, self._runner.token_to_kv_pool_allocator

    def get_tokens_per_layer_info(self):
        return None, None

    def get_pad_input_ids_func(self):
        return None

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.hicache_layer_transfer_counter = counter

    def set_hicache_consumer(self, consumer_index: int) -> None:
        if self.hicache_layer_transfer_counter is not None:
            self.hicache_layer_transfer_counter.set_consumer(consumer_index)


def standin_runner(pools: Any, model_config: Any, device: str, **fields: Any) -> Any:
    """The model runner fields upstream's scheduler, cache builder and ``ForwardBatch.init_new`` read."""
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import NgramEmbeddingManager

    tokens = pools.max_total_num_tokens
    return types.SimpleNamespace(
        is_draft_worker=False,
        device=device,
        model_config=model_config,
        ngram_embedding_manager=NgramEmbeddingManager(enabled=False, table=None, n=0),
        lora_manager=None,
        prefill_aware_swa=False,
        req_to_token_pool=pools.req_to_token_pool,
        token_to_kv_pool=pools.token_to_kv_pool,
        token_to_kv_pool_allocator=pools.allocator,
        max_running_requests=pools.max_running_requests,
        logical_max_total_num_tokens=tokens,
        effective_logical_max_total_num_tokens=tokens,
        forward_stream=None,
        mtp_draft_device_pools=(),
        mtp_draft_mamba_pools=(),
        sliding_window_size=None,
        is_hybrid_swa=False,
        canary_manager=None,
        model=None,
        **fields,
    )


class Recorder:
    """What the scheduler sends to its tokenizer / detokenizer (outputs, aborts), kept for the soak's ledger."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []

    def send_output(self, output: Any, recv_obj: Any = None) -> None:
        self.outputs.append(output)


class _NoStream:
    """A device stream where there is none (CPU): the overlap scheduler's waits order nothing."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


# Scheduler.__init__'s steps after its prelude, in upstream's order (its ``self.X()`` calls and the cache builder), and
# what the soak does for each: "call" (upstream's method itself), "soak: ..." (what stands in, in build_scheduler), or
# "skip: why". test/registered/soak holds this list to Scheduler.__init__'s source.
INIT_STEPS: tuple[tuple[str, str], ...] = (
    ("init_startup_timing_begin", "skip: start-up timing"),
    ("init_soft_watchdog", "skip: a watchdog thread"),
    ("init_model_config", "soak: the published args' model config"),
    ("init_zbal_on_npu", "skip: NPU"),
    ("init_metrics_collector", "call"),
    ("init_ipc_channels", "soak: recording senders, no sockets"),
    ("init_idle_sleeper", "skip: no sockets to poll"),
    ("init_pdmux", "skip: refused beside the mode"),
    ("init_tokenizer", "skip: --skip-tokenizer-init"),
    ("init_moe_gemm_config", "call"),
    ("init_mamba_backend", "skip: no mamba"),
    ("init_model_worker", "soak: the stand-in worker over build_pools' pools, get_worker_info's values, the groups"),
    ("init_kv_event_lora_names", "call"),
    ("kv_cache_builder.build_kv_cache", "soak: upstream's builder over the worker's pools"),
    ("emit_metrics_constants", "skip: metrics off"),
    ("maybe_init_hccl_dp_prewarm", "skip: NPU"),
    ("init_hisparse_coordinator", "call"),
    ("init_running_status", "call"),
    ("init_chunked_prefill", "call"),
    ("maybe_init_dynamic_chunk_sizer", "call"),
    ("init_diffusion_llm", "call"),
    ("init_metrics_reporter", "call"),
    ("init_kv_events_publisher", "call"),
    ("init_schedule_policy", "call"),
    ("init_watch_dog_memory_saver_input_blocker", "call"),
    ("init_profiler", "call"),
    ("maybe_init_rust_server", "skip: no HTTP server"),
    ("init_disaggregation", "call"),
    ("init_overlap", "soak: streams and events stood in (a CPU has none)"),
    ("maybe_init_ngram_embedding", "call"),
    ("init_deterministic_inference_config", "call"),
    ("init_dsa_kpool_truncation_align", "call"),
    ("init_mamba_truncation_align", "call"),
    ("check_truncation_align_fits_chunk", "call"),
    ("init_weight_updater", "call"),
    ("init_request_dispatcher", "call"),
    ("init_lora_drainer", "call"),
    ("init_lora_overlap_loader", "call"),
    ("init_grammar_manager", "call"),
    ("maybe_init_scripted_scheduler_hook", "call"),
    ("init_request_receiver", "soak: the workload's receiver (soak/prefill.py), set by the caller"),
    ("init_dp_attn_adapter", "call"),
    ("init_pool_stats_observer", "call"),
    ("init_invariant_checker", "call"),
    ("init_load_publisher", "call"),
    ("init_load_inquirer", "call"),
    ("init_output_streamer", "call"),
    ("init_batch_result_processor", "call"),
    ("init_internal_state", "call"),
    ("init_rank_consensus_checker", "call"),
    ("init_startup_timing_summary", "skip: start-up timing"),
)


def build_scheduler(args: Any, worker: Any, model_config: Any, *, device: str) -> Any:
    """A ``Scheduler`` of the published ``args`` with ``worker`` (a :class:`~sglang_cpkv.soak.model.StandInWorker`)
    as its model worker: the prelude of ``Scheduler.__init__``, then :data:`INIT_STEPS` in order."""
    from sglang.srt.managers.scheduler import Scheduler

    s = object.__new__(Scheduler)
    _prelude(s, args, model_config)
    soak_steps = {
        "init_ipc_channels": _ipc_channels,
        "init_model_worker": lambda s: _model_worker(s, worker),
        "kv_cache_builder.build_kv_cache": _tree_cache,
        "init_overlap": lambda s: _overlap(s, device),
    }
    for step, disposition in INIT_STEPS:
        if disposition == "call":
            getattr(Scheduler, step)(s)
        elif step in soak_steps:
            soak_steps[step](s)
    s.is_initializing = False
    return s


def _prelude(s: Any, args: Any, model_config: Any) -> None:
    """What ``Scheduler.__init__`` sets before its first ``init_*`` step, from the published args."""
    from sglang.srt.environ import envs
    from sglang.srt.observability.scheduler_stage_metrics import SchedulerStageMetricsRecorder
    from sglang.srt.runtime_context import get_disagg, get_memory, get_parallel, get_schedule, get_serving
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    schedule, memory = get_schedule(), get_memory()
    s.__dict__.update(
        is_initializing=True,
        forward_ct=0,
        processed_tokens_counter=0,
        cur_batch_for_debug=None,
        server_args=args,
        schedule_policy=schedule.schedule_policy,
        enable_priority_scheduling=schedule.enable_priority_scheduling,
        abort_on_priority_when_disabled=schedule.abort_on_priority_when_disabled,
        schedule_low_priority_values_first=schedule.schedule_low_priority_values_first,
        priority_scheduling_preemption_threshold=schedule.priority_scheduling_preemption_threshold,
        enable_lora=False,
        enable_lora_overlap_loading=False,
        max_loras_per_batch=0,
        enable_overlap=not schedule.disable_overlap_schedule,
        enable_overlap_mlx=False,
        enable_pdmux=get_disagg().enable_pdmux,
        skip_tokenizer_init=get_serving().skip_tokenizer_init,
        stream_interval=get_serving().stream_interval,
        spec_algorithm=SpeculativeAlgorithm.from_string(None),
        page_size=schedule.page_size,
        enable_hierarchical_cache=memory.enable_hierarchical_cache,
        enable_lmcache=memory.enable_lmcache,
        enable_session_radix_cache=memory.enable_session_radix_cache,
        enable_hicache_storage=memory.hicache_storage_backend is not None,
        enable_unified_cache_external_linker=memory.enable_unified_cache_external_linker,
        enable_decode_hicache=False,
        max_recv_per_poll=envs.SGLANG_SCHEDULER_MAX_RECV_PER_POLL.get(),
        max_new_tokens_limit=envs.SGLANG_MAX_NEW_TOKENS_LIMIT.get(),
        enable_hisparse=memory.enable_hisparse,
        attn_dp_enabled=get_parallel().attn_dp_enabled,
        enable_unified_memory=memory.enable_unified_memory,
        # init_model_config / the skipped steps' fields
        model_config=model_config,
        is_generation=True,
        tokenizer=None,
        idle_sleeper=None,
        rust_server=None,
        draft_worker=None,
        decode_offload_manager=None,
        enable_fpm=False,
        return_health_check_ipcs=[],
        scheduler_stage_metrics=SchedulerStageMetricsRecorder(enabled=False),
    )


def _ipc_channels(s: Any) -> None:
    from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels

    s.recorder = Recorder()
    s.recv_from_tokenizer = s.load_snapshot_writer = None
    s.ipc_channels = SchedulerIpcChannels(
        recv_from_tokenizer=None,
        recv_from_rpc=None,
        send_to_tokenizer=s.recorder,
        send_to_detokenizer=s.recorder,
        send_metrics_from_scheduler=None,
    )


def _model_worker(s: Any, worker: Any) -> None:
    """``init_model_worker`` with the stand-in worker: upstream's ``get_worker_info`` of it, the process groups."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.runtime_context import get_context, get_parallel

    parallel = get_parallel()
    s.tp_worker = s.model_worker = worker
    Scheduler.maybe_init_draft_worker(s)  # no speculative algorithm: no draft worker
    (
        s.max_total_num_tokens,
        s.max_prefill_tokens,
        s.max_running_requests,
        s.max_queued_requests,
        s.max_req_len,
        s.max_req_input_len,
        s.random_seed,
        s.device,
        s.forward_stream,
        *_,
    ) = TpModelWorker.get_worker_info(worker)
    s.min_free_slots_delayer = None
    if not parallel.pp_max_micro_batch_size:
        get_context().override("soak.pp_max_micro_batch_size_default", pp_max_micro_batch_size=s.max_running_requests)
    for name in ("tp", "attn_tp", "attn_cp", "pp"):
        group = getattr(parallel, f"{name}_group")
        setattr(s, f"{name}_group", group)
        setattr(s, f"{name}_cpu_group", group.cpu_group)
    s.world_group = parallel.world_group
    s.dp_tp_group = get_dp_tp_group()
    s.dp_tp_cpu_group = s.dp_tp_group.cpu_group
    s.pad_input_ids_func = None


def _tree_cache(s: Any) -> None:
    """Upstream's cache builder over the worker's pools (radix on or off, HiCache), as ``__init__`` calls it."""
    from sglang.srt.mem_cache import kv_cache_builder
    from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size

    result = kv_cache_builder.build_kv_cache(
        server_args=s.server_args,
        model_config=s.model_config,
        tp_worker=s.tp_worker,
        page_size=s.page_size,
        spec_algorithm=s.spec_algorithm,
        enable_metrics=False,
        enable_kv_cache_events=False,
        enable_hierarchical_cache=s.enable_hierarchical_cache,
    )
    s.is_hybrid_swa, s.is_hybrid_ssm = result.is_hybrid_swa, result.is_hybrid_ssm
    s.sliding_window_size, s.full_tokens_per_layer = result.sliding_window_size, result.full_tokens_per_layer
    s.swa_tokens_per_layer = result.swa_tokens_per_layer
    s.req_to_token_pool = result.req_to_token_pool
    s.token_to_kv_pool_allocator = result.token_to_kv_pool_allocator
    s.kv_shard_widening = page_interleave_shard_size(s.token_to_kv_pool_allocator)
    s.disable_radix_cache = result.disable_radix_cache
    s.tree_cache = result.tree_cache


def _overlap(s: Any, device: str) -> None:
    """``init_overlap`` on a CPU: no streams or device events to order the overlap scheduler's work."""
    s.device_module = types.SimpleNamespace(Event=_CpuEvent)
    s.forward_stream = s.schedule_stream = s.copy_stream = _NoStream()
    s.forward_stream_ctx = s.copy_stream_ctx = contextlib.nullcontext()
    s.batch_record_buf, s.batch_record_ct = [None] * 2, 0
    s.future_map = s.spec_algorithm.create_future_map(device, s.req_to_token_pool)
    s._confidence_budget_prepare = None
    s.enable_async_d2h_copy, s.async_d2h_worker = False, None
    s._war_barrier_enabled = False


class _CpuEvent:
    """A device event where there is none: recorded work on a CPU is already done."""

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, *args: Any) -> None:
        pass
