"""Layer-ahead history prefetch for ``--enable-cp-shared-kv`` (design: ``docs/design/cp-shared-kv.md`` section 4).

Each layer of an extend batch needs its history (latent KV and index K) materialized into the
per-request dense view: owned pages packed, all-gathered over the CP ranks, unpacked. While layer
``l`` computes, :class:`LayerAheadHistory` materializes layer ``l + 1`` into the other half of a
double buffer on a side stream (the runtime's :class:`~sglang_cpkv.runtime.prefetch.HistoryPrefetcher`,
one per kind, sharing that stream). The first layer of a batch starts its own materialization
(nothing to overlap); from then on each layer starts the next one when it takes its own.

Communicator: the all-gathers run on a process group of their own (:func:`create_exchange_group`,
the attention-CP ranks, made once at start-up right after upstream builds its attention-CP
group), used only from the prefetch stream, so they never interleave with the model's collectives
on upstream's communicators. On CPU (gloo) a prefetch runs synchronously when it is started.

Buffers: sized from the batch plan, kept across batches (:class:`DenseBufferCache`) and reallocated
only when a batch needs more rows than any before; no layer allocates.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime.group import CpGroup, TorchDistCpGroup
from sglang_cpkv.runtime.plan import CpSharedKvPlan
from sglang_cpkv.runtime.prefetch import HistoryPrefetcher

# The history exchange's own process group (None until created, or when the mode is off / cp = 1).
_exchange_group: TorchDistCpGroup | None = None


def create_exchange_group(ranks: list[int], backend: str) -> TorchDistCpGroup:
    """A process group over ``ranks`` (this rank's attention-CP group) for the history exchange.

    Only the members call it (``use_local_synchronization``), each at the same point of its
    start-up, so no other rank has to take part; every member of every CP group makes its own.
    """
    global _exchange_group
    import torch.distributed as dist

    if _exchange_group is not None:
        raise CpSharedKvError("the CP shared-KV exchange group was already created in this process")
    group = dist.new_group(ranks=sorted(ranks), backend=backend, use_local_synchronization=True)
    _exchange_group = TorchDistCpGroup(group)
    return _exchange_group


def exchange_group() -> TorchDistCpGroup:
    """The group :func:`create_exchange_group` made at start-up."""
    if _exchange_group is None:
        raise CpSharedKvError(
            "--enable-cp-shared-kv: no CP shared-KV exchange group in this process; it is made right after "
            "upstream's attention-CP group (initialize_model_parallel hook of "
            "patches/core/hook-cp-shared-kv-into-dsa-extend.patch)"
        )
    return _exchange_group


class DenseBufferCache:
    """Two dense buffers per (kind, row shape, dtype, device), kept across batches.

    :meth:`pair` returns views of the first ``rows`` rows of each; the storage grows only when a
    batch needs more rows than the cache holds. A new batch may reuse the storage the previous one
    read: its prefetch stream waits for the current stream before it writes (``HistoryPrefetcher``).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def pair(self, kind: str, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        key = (kind, row_shape, dtype, torch.device(device))
        held = self._buffers.get(key)
        if held is None or held[0].shape[0] < rows:
            held = tuple(torch.empty((rows, *row_shape), dtype=dtype, device=device) for _ in range(2))
            self._buffers[key] = held
        return held[0][:rows], held[1][:rows]


_buffer_cache = DenseBufferCache()
_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device):
    """One prefetch stream per device: the exchange group's collectives are issued from it only."""
    if device.type != "cuda":
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def index_k_pages_as_rows(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """An index-K page buffer ``[pages, page_bytes]`` seen as ``[pages * page_size, page_bytes / page_size]``
    rows, the runtime's pool/dense shape (only whole pages are ever copied through this view)."""
    return buffer.view(buffer.shape[0] * page_size, buffer.shape[1] // page_size)


class LayerAheadHistory:
    """One batch's history (latent KV and, for a DSA pool, index K) per layer, one layer ahead.

    Args:
        plan: the batch plan.
        group: the CP group of the exchange (:func:`exchange_group` under CP).
        pool: upstream's KV pool of the layers that will call :meth:`acquire`
            (``MLATokenToKVPool``/``DSATokenToKVPool``: ``kv_buffer``, ``start_layer``, ``layer_num``,
            and for index K ``get_index_k_with_scale_buffer``/``index_page_size``).
        buffers: where the dense buffers come from (default: the process-wide cache).
    """

    def __init__(
        self, plan: CpSharedKvPlan, group: CpGroup, pool: Any, buffers: DenseBufferCache | None = None
    ) -> None:
        self.plan = plan
        self.pool = pool
        self.first_layer = pool.start_layer
        self.end_layer = pool.start_layer + pool.layer_num
        cache = buffers if buffers is not None else _buffer_cache
        kv_rows = pool.kv_buffer[0]
        stream = _side_stream(kv_rows.device)
        kv_pair = cache.pair("latent", plan.dense_rows, tuple(kv_rows.shape[1:]), kv_rows.dtype, kv_rows.device)
        self._latent = HistoryPrefetcher(plan, group, kv_pair, stream)
        self._index_k: HistoryPrefetcher | None = None
        self._index_k_pages: tuple[torch.Tensor, torch.Tensor] | None = None
        if hasattr(pool, "get_index_k_with_scale_buffer"):
            page_size = pool.index_page_size
            index_pages = pool.get_index_k_with_scale_buffer(self.first_layer)
            pages = plan.num_requests * plan.pages_per_request
            self._index_k_pages = cache.pair(
                "index_k", pages, tuple(index_pages.shape[1:]), index_pages.dtype, index_pages.device
            )
            rows = tuple(index_k_pages_as_rows(b, page_size) for b in self._index_k_pages)
            self._index_k = HistoryPrefetcher(plan, group, rows, stream)
        self._started: set[int] = set()
        self._acquired: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _start(self, layer_id: int) -> None:
        # Every rank starts the same layers in the same order: latent, then index K.
        self._latent.start(layer_id, self.pool.kv_buffer[layer_id - self.first_layer])
        if self._index_k is not None:
            pages = self.pool.get_index_k_with_scale_buffer(layer_id)
            self._index_k.start(layer_id, index_k_pages_as_rows(pages, self.pool.index_page_size))
        self._started.add(layer_id)

    def acquire(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(dense latent KV, dense index-K pages or None)`` holding layer ``layer_id``'s history.

        The first call for a layer waits for its materialization (starting it when it is the
        batch's first layer) and starts the next layer's; later calls for the same layer return
        the same buffers. A collective under CP: every rank acquires the same layers in order.
        """
        if layer_id in self._acquired:
            return self._acquired[layer_id]
        if not self.first_layer <= layer_id < self.end_layer:
            raise CpSharedKvError(
                f"layer {layer_id} is not a layer of this pool ({self.first_layer}..{self.end_layer - 1})"
            )
        if layer_id not in self._started:
            self._start(layer_id)
        dense_kv = self._latent.wait(layer_id)
        dense_index_k = None
        if self._index_k is not None:
            self._index_k.wait(layer_id)
            dense_index_k = self._index_k_pages[layer_id % 2]
        if layer_id + 1 < self.end_layer and layer_id + 1 not in self._started:
            self._start(layer_id + 1)
        self._acquired = {layer_id: (dense_kv, dense_index_k)}  # earlier layers' buffers are being reused
        return self._acquired[layer_id]
