"""Upstream's own DSA attention kit driving the patched backend, with the CP shared-KV mode off or on (TEST-ONLY).

:class:`KitWorld` builds the kit's objects (``DSAMockModelRunner``, pools, the ``DeepseekSparseAttnBackend``, its
sparse attention modules) for a :class:`~sglang_cpkv.testing.batches.BatchCase` on one CP rank, runs forwards through
the patched backend and reduces every captured kernel call to what it reads (:class:`KernelReads`), so mode-on and
mode-off runs compare byte for byte; on a GPU the route's real kernel runs too. Callers: the kit tests, the harness,
the soak and the benchmarks (their timing: ``benchmark/kit_timing.py``). What differs from the kit's own cases:
``docs/design/cp-shared-kv-testing.md`` ("Upstream's DSA attention kit").
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from sglang_cpkv.hooks.reservation import publish as publish_reservation
from sglang_cpkv.runtime.ownership import owner_pool_loc, page_owner
from sglang_cpkv.testing.batches import BatchCase, same_bytes
from sglang_cpkv.testing.upstream_env import set_cp_shared_kv_flag

PAGE = 64
HEADS = 4
NOPE, ROPE = 512, 64
INDEX_HEAD_DIM = 128
TOPK = 128  # top-k width of the kit's sparse cases
KERNELS = ("_forward_flashmla_sparse", "_forward_flashmla_kv", "_forward_triton_sparse_mla")
# A DSA model config for server-args resolution under CP (DeepSeek-V3.2 shape; never loaded).
DSA_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "torch_dtype": "bfloat16",
    "rope_theta": 10000,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
}
# A model without DSA (Llama-3-8B shape; never loaded): what the mode refuses.
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


def kit_capacity(num_requests: int, longest: int, cp_size: int = 1) -> int:
    """Page ids of :class:`KitWorld` for ``num_requests`` requests of up to ``longest`` tokens (its ``max_requests``
    and ``longest``) at ``cp_size``: the pages of the pool ``DSAMockModelRunner`` makes, rounded up to a multiple of
    ``cp_size`` (under CP the page ids number ``cp`` x one rank's pool pages). Page ids ``[0, cp_size)`` are
    reserved, so a case's pages are drawn from ``[cp_size, capacity)``."""
    max_context = -(-longest // PAGE) * PAGE
    pages = 3 + num_requests * max_context // PAGE
    return cp_size * -(-pages // cp_size)


def kit_reservation(
    max_requests: int, longest: int, cp_size: int, *, latent_token_bytes: int, index_k_token_bytes: int
):
    """The reservation a :class:`KitWorld` of ``max_requests`` requests of up to ``longest`` tokens publishes (its
    server's ``--cp-shared-kv-max-batch-tokens`` is ``max_requests`` page-rounded contexts, its chunk
    ``max_requests * longest`` tokens), for pool rows of the given sizes."""
    from sglang_cpkv.hooks.settings import layer_ahead
    from sglang_cpkv.runtime.reservation import Reservation

    return Reservation(
        max_batch_tokens=max_requests * (-(-longest // PAGE) * PAGE),
        chunk_tokens=max_requests * longest,
        page_size=PAGE,
        cp_size=cp_size,
        layer_ahead=layer_ahead(cp_size),
        latent_token_bytes=latent_token_bytes,
        index_k_token_bytes=index_k_token_bytes,
    )


def distinct_page_tables(lengths, capacity: int, seed: int, cp_size: int = 1) -> tuple[tuple[int, ...], ...]:
    """Each request of ``lengths`` tokens its own pages, drawn across ``[cp_size, capacity)`` (the page ids
    ``[0, cp_size)`` are reserved, :func:`kit_capacity`) so that requests interleave in the pool (every owner's, under
    CP)."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(capacity - cp_size, generator=gen).add(cp_size).tolist()
    tables = []
    for n in lengths:
        count = -(-n // PAGE)
        tables.append(tuple(pages[:count]))
        pages = pages[count:]
    return tuple(tables)


def write_dsa_model_dir(directory) -> str:
    """``directory`` as the model path a server's args resolve: a ``config.json`` of :data:`DSA_CONFIG`."""
    Path(directory, "config.json").write_text(json.dumps(DSA_CONFIG))
    return str(directory)


@dataclass(frozen=True)
class KitRoute:
    """Where a server's extend batch goes: pool format, prefill backend, top-k fusion, layers."""

    prefill_backend: str = "flashmla_sparse"  # flashmla_sparse | flashmla_kv | triton_sparse_mla
    fp8: bool = False  # the 656-byte packed FP8 pool (else bf16 576-element rows)
    fused_topk: bool = True
    skip_topk_layers: tuple[bool, ...] = (False,)  # one per layer; True: an IndexShare layer

    @property
    def num_layers(self) -> int:
        return len(self.skip_topk_layers)


@dataclass
class KernelReads:
    """One attention-kernel call reduced to what it reads."""

    kernel: str
    q: torch.Tensor  # [rows, heads, dim], the query rows it was handed
    rows: torch.Tensor  # uint8 [rows, K, row_bytes]: the KV bytes each query row addresses (zeros for -1)
    valid: torch.Tensor  # bool [rows, K]
    output: torch.Tensor | None  # the kernel's output where it ran (a GPU world with run_kernels), else None


def _upstream():
    # Under DSA prefill CP upstream never takes the dense MHA_ONE_SHOT path (set_dsa_prefill_impl); these runs are
    # mostly cp 1, where a short batch on SM90 would: keep them on the sparse path the mode serves.
    os.environ.setdefault("SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD", "0")
    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # build the backend as on Hopper
        # The top-k v2 plan is a CUDA JIT kernel of the top-k step, which these runs replace by its transform.
        os.environ.setdefault("SGLANG_OPT_USE_TOPK_V2", "0")
        _skip_dropped_overflow_checks()
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    import sglang.srt.layers.attention.dsa_backend as dsa_backend_module
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as dense_kit
    from sglang.test.kits.attention_unittest.attention_methods import dsa_attention as kit

    return dict(
        kit=kit,
        dense_kit=dense_kit,
        backends=ATTENTION_BACKENDS,
        pool_cls=DSATokenToKVPool,
        extend=ForwardMode.EXTEND,
        context=lambda backend: forward_context(ForwardContext(attn_backend=backend)),
        dsa_backend_module=dsa_backend_module,
        indexer_cls=Indexer,
    )


def _skip_dropped_overflow_checks() -> None:
    """Triton's interpreter computes an overflow check for every integer add, sub and mul, then drops it: its
    ``device_assert`` does nothing unless ``options.debug``, which the interpreter never sets. Not computing them
    changes no result and takes a fifth off upstream's cache writers on CPU (their launches are most of the kit's
    time)."""
    import dataclasses

    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    if not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _values(loc: torch.Tensor, salt: int, width: int, capacity: int, device) -> torch.Tensor:
    """bf16 rows that are a function of (pool location, salt, device) only: one history per pool location, whoever
    reads it, and the same rows for a request at bs = 1 as in a batch. Drawn on the device (a GPU draws a
    128K-token table in microseconds, where the host takes seconds)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(salt)
    table = torch.randn(capacity * PAGE, width, generator=gen, device=device)
    return table[loc.to(device)].to(torch.bfloat16)


# The library each prefill backend's real kernel comes from (flashmla_auto runs one of the flashmla kernels).
KERNEL_LIBRARY = {"flashmla_sparse": "flash_mla", "flashmla_kv": "flash_mla", "flashmla_auto": "flash_mla"}


def missing_kernel_library(route: KitRoute) -> str | None:
    """The Python module the route's real kernel needs that is not installed here, else None."""
    library = KERNEL_LIBRARY.get(route.prefill_backend)
    return library if library and importlib.util.find_spec(library) is None else None


class _Capture:
    """Replaces the backend's kernels with recorders (upstream's RAGGED dequantization runs as it is: its Triton
    kernel, on CPU in the interpreter)."""

    def __init__(self, backend: Any, run_kernels: bool) -> None:
        self.calls: list[KernelReads] = []
        self._backend = backend
        flash_mla = importlib.util.find_spec("flash_mla") is not None
        for name in KERNELS:
            run = run_kernels and ("triton" in name or flash_mla)
            setattr(backend, name, self._kernel(name, getattr(backend, name), run))
        if not flash_mla:
            # flashmla_kv's scheduling metadata comes from the flash_mla library, absent here with its kernel.
            backend._compute_flashmla_metadata = lambda cache_seqlens, seq_len_q: SimpleNamespace(
                flashmla_metadata=None, num_splits=None
            )

    def restore(self) -> None:
        for name in (*KERNELS, "_compute_flashmla_metadata"):
            self._backend.__dict__.pop(name, None)

    def _kernel(self, name: str, real: Callable, run: bool) -> Callable:
        def record(*args, **kwargs):
            q, kv, indices = kwargs["q_all"], kwargs["kv_cache"], kwargs["page_table_1"]
            output = real(*args, **kwargs) if run else None
            self.calls.append(_reads(name, q, kv, indices, output))
            if output is not None:
                return output
            return q.new_zeros(q.shape[0], q.shape[1], NOPE)

        return record


def _reads(name: str, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, output) -> KernelReads:
    rows = kv.reshape(-1, kv.shape[-1]).contiguous().view(torch.uint8)
    idx = indices.reshape(q.shape[0], -1).to(torch.int64).cpu()
    valid = idx >= 0
    gathered = rows.cpu()[idx.clamp(min=0)] * valid.unsqueeze(-1).to(torch.uint8)
    return KernelReads(name, q.detach().cpu().clone(), gathered, valid, None if output is None else output.cpu())


@dataclass
class KitRun:
    """One rank's forward of a batch: what every layer's kernel read, the index K it read, its pool after."""

    kernel: list[KernelReads]  # one per layer
    index_k: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (keys, scales) as the indexer read them
    local_tokens: torch.Tensor  # global token of each real local query row
    pool_after: list[torch.Tensor]  # per layer, this rank's KV pool rows as bytes (KitWorld.pool_rows: their locations)


def request_reads(runs_and_cases, layer: int = 0) -> dict:
    """``{(request, position): (valid, rows)}`` of every query row of the runs (one per CP rank) of one case: what
    the kernel of ``layer`` read for it."""
    reads = {}
    for run, case in runs_and_cases:
        starts = [sum(case.extend_lens[:r]) for r in range(case.num_requests)]
        kernel = run.kernel[layer]
        for i, t in enumerate(run.local_tokens.tolist()):
            r = max(k for k in range(case.num_requests) if starts[k] <= t)
            reads[(r, case.prefix_lens[r] + t - starts[r])] = (kernel.valid[i], kernel.rows[i])
    return reads


def assert_reads_alone(batch_reads: dict, alone_reads: dict, what: str) -> None:
    """Every query row of a batch read the bytes the same request's row read in its run alone."""
    assert batch_reads.keys() == alone_reads.keys(), what
    for key, (valid, rows) in batch_reads.items():
        alone_valid, alone_rows = alone_reads[key]
        assert torch.equal(valid, alone_valid), (what, key)
        assert same_bytes(rows, alone_rows), f"{what}: request {key[0]} position {key[1]} reads other rows than alone"


def _kit_case(up: dict, case: BatchCase, heads: int):
    return up["kit"].DSAAttentionCase(
        name="cpkv",
        backend="dsa",
        forward_mode=up["extend"],
        num_heads=heads,
        num_kv_heads=1,
        page_size=PAGE,
        prefix_lens=tuple(case.prefix_lens),
        extend_lens=tuple(case.extend_lens),
    )


def _require_cuda_ops_on_gpu(device: torch.device) -> None:
    """On a GPU the mode's ops must run on their CUDA backend, the kernels a server with the image's prebuilt library
    runs: where the library is missing or fails its probe the dispatcher falls back to Triton
    (:mod:`sglang_cpkv.ops`), and a kit test or figure would then prove the fallback instead."""
    from sglang_cpkv import ops
    from sglang_cpkv.ops import cuda

    if device.type != "cuda":
        return
    backend = ops.select_backend(device)
    if backend != "cuda":
        why = cuda.unavailable_reason() or f"{ops.BACKEND_ENV} selects {backend}"
        raise ops.CpSharedKvError(f"the kit on {device} runs the mode's CUDA ops, which cannot serve here: {why}")


class KitWorld:
    """One CP rank's upstream objects, built by the kit, kept across the forwards of a test (so a chunked
    continuation reads the history its first chunk persisted).

    Attributes:
        capacity: the page ids a case is laid out on (``kit_capacity(pool_requests or max_requests, longest,
            cp_size)``); the rank's pool holds ``capacity / cp_size`` pages with the mode on at cp > 1, else
            ``capacity`` (docs/design/cp-shared-kv-testing.md).
        allocator: upstream's ``PageInterleavePoolAllocator`` of the mode at cp > 1 (the runner's
            ``token_to_kv_pool_allocator``), else None.

    Args:
        route: pool format, prefill backend, top-k fusion and layers.
        max_requests, longest: the kit runner's shape (``DSAMockModelRunner``'s ``ReqToTokenPool`` rows and
            its pool of ``kit_capacity(max_requests, longest)`` pages).
        mode_on: ``--enable-cp-shared-kv`` as published in this process.
        cp_size, cp_rank: the attention-CP rank (cp > 1: the caller published the server's args and made the
            exchange group, :func:`publish_prefill_cp_server_args`).
        run_kernels: also run the real attention kernel (GPU): ``triton_sparse_mla``, and the ``flashmla_*`` ones
            where the ``flash_mla`` library is installed (:func:`missing_kernel_library`).
        pool_requests: size the page ids for this many requests of ``longest`` tokens instead of ``max_requests``
            (the kit's formula; a smaller pool than the batch's tokens needs prefix sharing).
        heads, topk: attention heads of a layer and its top-k width (the kit's sparse cases: 4 and 128;
            DeepSeek-V3.2's top-k is 2048; upstream's ``triton_sparse_mla`` refuses more than 32 heads per rank;
            GLM-5.1 at cp 8 runs 64 per rank, FlashMLA's Hopper head block).
    """

    def __init__(
        self,
        route: KitRoute,
        *,
        max_requests: int,
        longest: int,
        mode_on: bool,
        device: torch.device | str,
        cp_size: int = 1,
        cp_rank: int = 0,
        run_kernels: bool = False,
        seed: int = 0,
        pool_requests: int | None = None,
        heads: int = HEADS,
        topk: int = TOPK,
    ) -> None:
        up = _upstream()
        if mode_on:
            _require_cuda_ops_on_gpu(torch.device(device))
        self.heads, self.topk = heads, topk
        self.up, self.route, self.mode_on, self.seed = up, route, mode_on, seed
        self.device = torch.device(device)
        self.cp_size, self.cp_rank, self.run_kernels = cp_size, cp_rank, run_kernels
        kit, dense_kit = up["kit"], up["dense_kit"]
        self.max_context = -(-longest // PAGE) * PAGE
        shape = BatchCase(PAGE, 1, ((1,),) * max_requests, (0,) * max_requests, (longest,) * max_requests)
        model_config = kit.TinyDSAModelConfig(
            num_heads=heads,
            num_kv_heads=1,
            head_dim=NOPE + ROPE,
            hidden_size=dense_kit.DEFAULT_HIDDEN_SIZE,
            context_len=self.max_context,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            kv_lora_rank=NOPE,
            index_topk=topk,
        )
        from sglang.srt.runtime_context import get_context, get_parallel

        published = get_context()._server_args  # the server's args (CP runs), put back after the kit's own
        # The kit's dense-attention module states attn_dcp_rank once, at its import (an override it never exits); a
        # test's scoped upstream context (testing/pool_sizing.scoped_upstream_context) drops it after the test that
        # imported the kit, so each world states decode CP off itself before the kit's runner reads it.
        get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)
        runner = kit.DSAMockModelRunner(
            case=_kit_case(up, shape, heads),
            model_config=model_config,
            dtype=torch.bfloat16,
            device=str(self.device),
            max_context_len=self.max_context,
            head_dim=NOPE + ROPE,
            dsa_prefill_backend=route.prefill_backend,
            dsa_decode_backend="flashmla_kv",
            fp8_kv_cache=route.fp8,
        )
        kit_pool = runner.token_to_kv_pool
        if pool_requests is None and (kit_pool.size + PAGE) // PAGE != kit_capacity(max_requests, longest):
            raise AssertionError("kit_capacity no longer follows DSAMockModelRunner's pool")
        self.capacity = kit_capacity(max_requests if pool_requests is None else pool_requests, longest, cp_size)
        # With the mode on under CP a rank's pool holds its owned pages only (docs/design/cp-shared-kv-testing.md).
        self.widened = mode_on and cp_size > 1
        pool_pages = self.capacity // cp_size if self.widened else self.capacity
        runner.token_to_kv_pool = up["pool_cls"](
            size=(pool_pages - 1) * PAGE,
            page_size=PAGE,
            kv_lora_rank=NOPE,
            dtype=kit_pool.dtype,
            qk_rope_head_dim=ROPE,
            layer_num=route.num_layers,
            device=str(self.device),
            index_head_dim=INDEX_HEAD_DIM,
            enable_memory_saver=False,
            kv_cache_dim=kit_pool.kv_buffer[0].shape[-1],
            skip_topk_layers=list(route.skip_topk_layers),
        )
        self.runner, self.pool = runner, runner.token_to_kv_pool
        self.reservation = self._reservation(max_requests, longest) if mode_on else None
        if mode_on:
            publish_reservation(self.reservation)
        self.backend = up["backends"]["dsa"](runner)
        self.backend.use_fused_topk = route.fused_topk
        if published is not None and cp_size > 1:
            runner._server_args_override.restore()  # the forward sees the server's published args
        set_cp_shared_kv_flag(mode_on)
        get_parallel().override_permanently(
            attn_cp_size=cp_size, attn_cp_rank=cp_rank, attn_dcp_size=1, attn_dcp_rank=0
        )
        self.allocator = None
        if self.widened:
            # The token allocator the patched KV-cache configurator builds under the mode (it reads the published
            # args and the attention-CP size, both in place now); the mode's extend refuses a CP pool without it.
            from sglang_cpkv.hooks.page_ids import page_interleave_allocator

            self.allocator = page_interleave_allocator(
                pool_tokens=self.pool.size,
                page_size=PAGE,
                dtype=self.pool.dtype,
                device=str(self.device),
                kvcache=self.pool,
                need_sort=False,
            )
            if self.allocator.num_pages + cp_size != self.capacity:
                raise AssertionError(
                    f"the allocator numbers {self.allocator.num_pages} + {cp_size} reserved page ids, the world "
                    f"{self.capacity}"
                )
            runner.token_to_kv_pool_allocator = self.allocator
        torch.manual_seed(seed)
        self.modules = []
        for layer in range(route.num_layers):
            module = kit.ProjectedDSASparseAttention(
                hidden_size=dense_kit.DEFAULT_HIDDEN_SIZE,
                num_heads=heads,
                qk_nope_head_dim=NOPE,
                qk_rope_head_dim=ROPE,
                dtype=torch.bfloat16,
                device=str(self.device),
            )
            module.attn.layer_id = layer
            self.modules.append(module)
        self.act_quant = _act_quant()

    def _check(self, case: BatchCase) -> None:
        if case.capacity != self.capacity or case.cp_size != self.cp_size:
            raise ValueError(
                f"the case must be laid out on this world's pool: capacity {self.capacity}, cp {self.cp_size}; "
                f"got {case.capacity}, {case.cp_size}"
            )
        reserved = sorted({p for table in case.page_tables for p in table if p < self.cp_size})
        if reserved:
            raise ValueError(
                f"the case uses reserved page ids {reserved}: page ids [0, {self.cp_size}) are pool page 0 of a rank "
                "(the allocator never hands them out)"
            )

    def _hidden(self, locs: torch.Tensor, layer: int) -> torch.Tensor:
        return _values(
            locs, 1000 * self.seed + layer, self.up["dense_kit"].DEFAULT_HIDDEN_SIZE, self.capacity, self.device
        )

    def _keys(self, locs: torch.Tensor, layer: int) -> torch.Tensor:
        return _values(locs, 5000 * self.seed + layer, INDEX_HEAD_DIM, self.capacity, self.device)

    def _reservation(self, max_requests: int, longest: int):
        """The mode's reservation for this world, as the pool-sizing hook makes it at a server's start-up: a batch of
        up to ``max_requests`` requests of up to ``longest`` tokens (row sizes from the pool; the layer-ahead
        setting in force now)."""
        pool = self.pool
        kv = pool.kv_buffer[0]
        index_k_layer = next(i for i, skip in enumerate(self.route.skip_topk_layers) if not skip)
        return kit_reservation(
            max_requests,
            longest,
            self.cp_size,
            latent_token_bytes=kv[0].numel() * kv.element_size(),
            index_k_token_bytes=pool.get_index_k_with_scale_buffer(index_k_layer).shape[1] // PAGE,
        )

    def make_current(self) -> None:
        """Make this world's configuration the process's again (the flag and, mode on, its reservation, which are
        process-wide): a caller that runs several worlds in turn calls it before each one's forward."""
        set_cp_shared_kv_flag(self.mode_on)
        if self.reservation is not None:
            publish_reservation(self.reservation)

    def pool_rows(self, locs: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's pool that hold token locations ``locs`` (owned ones, with the mode on under CP:
        :func:`~sglang_cpkv.runtime.ownership.owner_pool_loc`; the locations themselves in a replica)."""
        if not self.widened:
            return locs
        if bool((page_owner(locs // PAGE, self.cp_size) != self.cp_rank).any()):
            raise ValueError(f"rank {self.cp_rank}'s pool holds only the pages it owns")
        return owner_pool_loc(locs, PAGE, self.cp_size)

    def write_history(self, case: BatchCase) -> None:
        """The pool rows of every request's prefix positions, as an earlier prefill wrote them (a radix hit's
        history): every row with the mode off; under the mode at cp > 1 each rank's owned token locations, at
        their rows of its pool (:meth:`pool_rows`). The values are those of the token location either way."""
        self._check(case)
        per_request = [
            (torch.tensor(table, dtype=torch.int64)[:, None] * case.page_size + torch.arange(case.page_size)).flatten()[
                :prefix
            ]
            for table, prefix in zip(case.page_tables, case.prefix_lens)
        ]
        locs = torch.cat(per_request).unique()  # sorted, each pool location once
        if self.widened:
            locs = locs[page_owner(locs // PAGE, self.cp_size) == self.cp_rank]
        if not locs.numel():
            return
        rows = self.pool_rows(locs).to(self.device)
        for layer, module in enumerate(self.modules):
            k_nope, k_rope = module.project_k(self._hidden(locs, layer))
            self.pool.set_mla_kv_buffer(module.attn, rows, k_nope.view(-1, 1, NOPE), k_rope)
            if not self.route.skip_topk_layers[layer]:
                index_k, index_k_scale = self.act_quant(self._keys(locs, layer), 128, None)
                self.pool.set_index_k_scale_buffer(layer, rows, index_k, index_k_scale)

    def _extend_batch(self, case: BatchCase):
        """The kit's forward batch of ``case`` (our page layout), the chunk's pool locations, and this rank's
        real local tokens with upstream's ``attn_cp_metadata`` under CP (else None)."""
        self._check(case)
        # The kit writes req_to_token one element at a time (on a GPU a kernel launch each: seconds for a batch of
        # 128K-token requests); its writes land in a host copy that goes to the device in one transfer.
        pool = self.runner.req_to_token_pool
        device_table = pool.req_to_token
        pool.req_to_token = device_table.cpu().numpy()
        try:
            forward_batch = self.up["dense_kit"]._make_forward_batch(
                _kit_case(self.up, case, self.heads),
                self.runner,
                max_context_len=self.max_context,
                device=str(self.device),
                loc_fn=case.pool_loc,
            )
        finally:
            device_table.copy_(torch.from_numpy(pool.req_to_token))
            pool.req_to_token = device_table
        cur_locs = torch.tensor(case.out_cache_loc(), dtype=torch.int64)
        local_tokens, metadata_cp = _cp_split(case, forward_batch, self.cp_rank)
        return forward_batch, cur_locs, local_tokens, metadata_cp

    def forward(self, case: BatchCase, *, layers_see_another_forward_batch: bool = False) -> KitRun:
        """One extend forward of ``case`` through the patched backend (this rank's share under CP).

        ``layers_see_another_forward_batch``: the layers run with a second forward batch of the same case, not the
        one ``init_forward_metadata`` was given (the state the mode must refuse)."""
        up, route, device, backend = self.up, self.route, self.device, self.backend
        forward_batch, cur_locs, local_tokens, metadata_cp = self._extend_batch(case)
        layers_batch = self._extend_batch(case)[0] if layers_see_another_forward_batch else forward_batch
        capture = _Capture(backend, self.run_kernels)
        kernel_reads, index_reads = [], {}
        try:
            with torch.no_grad(), up["context"](backend):
                backend.init_forward_metadata(forward_batch)
                metadata = backend.forward_metadata
                for layer, module in enumerate(self.modules):
                    if not route.skip_topk_layers[layer]:
                        index_reads[layer] = _index_k_store_and_read(
                            up, backend, layers_batch, layer, self._keys(cur_locs, layer), self.act_quant
                        )
                    hidden = self._hidden(cur_locs, layer)
                    q_nope, q_rope = module.project_q(hidden[local_tokens.to(device)])
                    q_nope, q_rope = pad_rows(q_nope, metadata_cp), pad_rows(q_rope, metadata_cp)
                    k_nope, k_rope = module.project_k(hidden)  # the chunk's rows, as the all-gather hands them
                    topk = fused_topk(
                        backend, metadata, case, local_tokens, q_nope.shape[0], route, device, up["extend"], self.topk
                    )
                    module.attn(q_nope, k_nope, k_nope, layers_batch, k_rope=k_rope, q_rope=q_rope, topk_indices=topk)
                    kernel_reads.append(capture.calls.pop())
        finally:
            capture.restore()
        pool_after = [
            self.pool.kv_buffer[layer].contiguous().view(torch.uint8).cpu().clone() for layer in range(route.num_layers)
        ]
        self.forward_batch = forward_batch
        return KitRun(kernel_reads, index_reads, local_tokens, pool_after)


def _act_quant():
    from sglang.kernels.ops.quantization.act_quant_triton import act_quant

    return act_quant


def _cp_split(case: BatchCase, forward_batch: Any, cp_rank: int) -> tuple[torch.Tensor, Any]:
    """This rank's real local tokens; under CP also upstream's ``attn_cp_metadata`` on the batch."""
    n = case.num_tokens
    if case.cp_size == 1 or n < case.cp_size:
        forward_batch.attn_cp_metadata = None
        return torch.arange(n), None
    from sglang.srt.layers.cp.base import get_cp_strategy
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical

    seq = [p + e for p, e in zip(case.prefix_lens, case.extend_lens)]
    metadata = get_cp_strategy().build_metadata(num_tokens=n, seqs_len=seq, extend_seqs_len=list(case.extend_lens))
    pad_logical_token_to_physical(metadata)
    forward_batch.attn_cp_metadata = metadata
    forward_batch.global_num_tokens_cpu = None
    return torch.arange(cp_rank, n, case.cp_size), metadata


def pad_rows(x: torch.Tensor, metadata: Any) -> torch.Tensor:
    """Upstream pads a rank's local rows with zero rows to the physical length."""
    if metadata is None:
        return x
    from sglang.srt.runtime_context import get_parallel

    physical = metadata.per_rank_actual_token[get_parallel().attn_cp_rank]
    return torch.cat([x, x.new_zeros(physical - x.shape[0], *x.shape[1:])])


def fused_topk(
    backend: Any,
    metadata: Any,
    case: BatchCase,
    local_tokens: torch.Tensor,
    rows: int,
    route: KitRoute,
    device: torch.device,
    forward_mode: Any,
    topk: int,
) -> torch.Tensor:
    """What the indexer's top-k hands attention for each local query row: the trailing ``topk`` causal
    positions of its request (the kit's pattern), as :func:`topk_indices_of_positions` hands them."""
    token_req = torch.tensor([r for r in range(case.num_requests) for _ in range(case.extend_lens[r])])
    token_pos = torch.tensor(
        [
            p
            for r in range(case.num_requests)
            for p in range(case.prefix_lens[r], case.prefix_lens[r] + case.extend_lens[r])
        ]
    )
    positions = torch.full((rows, topk), -1, dtype=torch.int64)
    for i, t in enumerate(local_tokens.tolist()):
        visible = int(token_pos[t]) + 1
        window = torch.arange(max(0, visible - topk), visible)
        positions[i, : window.numel()] = window
    indices = topk_indices_of_positions(
        backend, metadata, positions, token_req[local_tokens], route.fused_topk, forward_mode
    )
    return indices.to(device)


def topk_indices_of_positions(
    backend: Any, metadata: Any, positions: torch.Tensor, row_requests: torch.Tensor, fused: bool, forward_mode: Any
) -> torch.Tensor:
    """int32 ``[rows, K]``: what the indexer's top-k hands attention for query rows whose top-k are the request-local
    ``positions`` (``-1``: none; padded rows past ``row_requests`` read nothing), transformed as upstream's fused top-k
    kernel does (RAGGED: ``position + topk_indices_offset[row]``; PAGED: the row's request's row of ``page_table_1``,
    the rank's selected requests in order), or left as positions when top-k is unfused (``forward_extend``
    transforms them). ``row_requests``: the batch request of each real local row, in local order."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    rows = positions.shape[0]
    if not fused:
        return positions.to(torch.int32)
    method = backend.get_topk_transform_method(forward_mode)
    valid = positions >= 0
    if method == TopkTransformMethod.RAGGED:
        # One offset per real local row; the padded rows past them read nothing.
        offset = metadata.topk_indices_offset.to(torch.int64).cpu().reshape(-1)
        row_offset = torch.zeros(rows, dtype=torch.int64)
        row_offset[: offset.numel()] = offset[:rows]
        return torch.where(valid, positions + row_offset[:, None], -1).to(torch.int32)
    # PAGED: the row's request's row of page_table_1 (the selected requests of this rank, in order).
    local_reqs = row_requests.to(torch.int64)
    selected = sorted(set(local_reqs.tolist()))
    table_row = torch.tensor([selected.index(int(r)) for r in local_reqs] + [0] * (rows - local_reqs.numel()))
    table = metadata.page_table_1.to(torch.int64).cpu()
    out = torch.where(valid, table[table_row[:, None], positions.clamp(min=0)], -1)
    return out.to(torch.int32)


def _index_k_store_and_read(up: dict, backend: Any, forward_batch: Any, layer: int, keys: torch.Tensor, act_quant):
    """The indexer's index-K store (upstream's ``Indexer._store_index_k_cache``, patched) of the chunk's keys,
    then its read with the metadata's block table (the patched call of ``_get_topk_ragged``)."""
    from sglang_cpkv.hooks import dsa_index_k

    indexer = SimpleNamespace(block_size=128, scale_fmt=None)  # the attributes the store reads of its Indexer
    up["indexer_cls"]._store_index_k_cache(indexer, forward_batch, layer, keys, act_quant=act_quant)
    metadata = backend.get_indexer_metadata(layer, forward_batch)
    seq_lens = metadata.get_indexer_seq_len_cpu()
    block_tables = metadata.get_logical_page_table()
    k, s = dsa_index_k.index_k_and_scale(
        backend.token_to_kv_pool,
        forward_batch,
        layer,
        metadata.get_indexer_seq_len(),
        block_tables,
        int(seq_lens.sum()),
        int(seq_lens.max()),
    )
    return k.cpu(), s.cpu()


def run_kit_ranks(rank_fn: Callable, cp_size: int, directory) -> list:
    """``rank_fn(rank, model_dir, init_method, out_dir)`` in ``cp_size`` processes over gloo (a kit model directory and
    the rendezvous file in ``directory``); each rank saves its results as ``rank{rank}.pt`` there. Returns them."""
    import torch.multiprocessing as mp

    directory = Path(directory)
    write_dsa_model_dir(directory)
    init_method = f"file://{directory / 'dist_init'}"
    mp.spawn(rank_fn, args=(str(directory), init_method, str(directory)), nprocs=cp_size, join=True)
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(cp_size)]


def publish_prefill_cp_server_args(model_dir: str, cp_size: int, mode_on: bool) -> None:
    """Resolve and publish a P/D prefill server's args with DSA prefill CP (what a prefill scheduler does)."""
    import os

    from sglang.srt.layers.cp.base import init_cp_strategy
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    os.environ["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    argv = [
        "--model-path",
        model_dir,
        "--skip-tokenizer-init",
        "--device",
        "cuda",
        "--tp",
        str(cp_size),
        "--enable-prefill-cp",
        "--cp-strategy",
        "interleave",
        "--disaggregation-mode",
        "prefill",
        "--random-seed",
        "1",
    ] + (["--enable-cp-shared-kv"] if mode_on else [])
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    set_global_server_args_for_scheduler(server_args)
    init_cp_strategy(enable_prefill_cp=True, cp_size=cp_size, cp_strategy="interleave")


def init_cp_rank(
    rank: int, cp_size: int, device: str, init_method: str, model_dir: str, dist_backend: str | None = None
) -> str:
    """Make this process CP rank ``rank`` of ``cp_size`` as a prefill server does: the kit's single-rank pin
    lifted, the server's args published (the mode on), upstream's distributed init and the patched
    ``initialize_model_parallel`` (which makes the mode's exchange group, on the same backend). Returns the rank's
    device.

    ``dist_backend``: ``"nccl"`` (the default on a GPU: rank ``k`` on GPU ``k``) or ``"gloo"`` (the default on
    CPU). Gloo on a GPU puts every rank on GPU 0 (NCCL refuses two ranks of one communicator on one device; gloo
    moves CUDA tensors through the host): upstream's groups are then built without their NCCL and custom
    all-reduce communicators, so every collective, the mode's history all-gather included, is gloo's."""
    _upstream()["kit"]._parallel_override.__exit__(None, None, None)  # the kit pins cp 1 when imported
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_parallel

    cuda = torch.device(device).type == "cuda"
    dist_backend = dist_backend or ("nccl" if cuda else "gloo")
    if dist_backend not in ("nccl", "gloo") or (dist_backend == "nccl" and not cuda):
        raise ValueError(f"dist_backend {dist_backend!r} on {device}: nccl needs a GPU, else gloo")
    shared_gpu = cuda and dist_backend == "gloo"
    local_rank = rank if dist_backend == "nccl" else 0
    if cuda:
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if shared_gpu:
        parallel_state.set_custom_all_reduce(False)
        build_group = parallel_state.init_model_parallel_group

        def without_nccl(*args, **kwargs):
            return build_group(*args, **{**kwargs, "use_pynccl": False})

        parallel_state.init_model_parallel_group = without_nccl
    publish_prefill_cp_server_args(model_dir, cp_size, mode_on=True)
    get_parallel().override_permanently(tp_rank=rank, attn_cp_rank=rank, attn_dcp_size=1, attn_dcp_rank=0)
    parallel_state.init_distributed_environment(
        world_size=cp_size,
        rank=rank,
        distributed_init_method=init_method,
        local_rank=local_rank,
        backend=dist_backend,
    )
    parallel_state.initialize_model_parallel()
    return device
