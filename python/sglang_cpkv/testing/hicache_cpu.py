"""Upstream's HiCache around a :class:`~sglang_cpkv.testing.dsa_kit.KitWorld`, on CPU tensors (tests only).

The objects are upstream's: the host pool group its DSA strategy declares (through the patched
``build_kv_host_pool``) and ``HybridCacheController`` (kernel I/O, host memory mode ``cache``) over the world's pool
and allocator. :func:`cpu_host_transfers` stands in, for the time of a test, the three pieces that cannot run on a
CPU: host pinning (skipped), ``sgl_kernel``'s MLA transfer ops (byte copies of the same rows) and the layer
counter's events (:class:`LayerLoadGate`: a layer's loaded rows land only when it is awaited). Used by
``integration/test_cp_shared_kv_hicache.py`` and the soak; design: ``docs/design/cp-shared-kv-hicache.md``, "What
runs on a CPU".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

MEM_LAYOUTS = ("layer_first", "page_first")


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, bytes]`` (a 0-row tensor too), a view."""
    data = t.view(torch.uint8)
    return data.reshape(data.shape[0], data[0].numel() if data.shape[0] else 0)


class _PointerTable:
    """The tensors behind the pointer tables upstream's all-layer transfer ops take (``data_ptr()`` values)."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}

    def add(self, tensors) -> None:
        for t in tensors:
            self.tensors[t.data_ptr()] = t

    def per_layer(self, src, dst, src_indices, dst_indices, item_size, **_):
        s, d = byte_rows(src), byte_rows(dst)
        if s.shape[1] != item_size or d.shape[1] != item_size:
            raise AssertionError(f"row sizes {s.shape[1]}, {d.shape[1]} != item size {item_size}")
        d[dst_indices.long()] = s[src_indices.long()]

    def per_layer_pf_lf(self, src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_):
        s, d = byte_rows(src), byte_rows(dst)
        if s.shape[1] != src_layout_dim or d.shape[1] != item_size:
            raise AssertionError(f"row sizes {s.shape[1]}, {d.shape[1]} != {src_layout_dim}, {item_size}")
        d[dst_indices.long()] = s[src_indices.long(), layer_id * item_size : (layer_id + 1) * item_size]

    def all_layer(self, src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, **_):
        for src, dst in zip(src_layers.tolist()[:num_layers], dst_layers.tolist()[:num_layers]):
            self.per_layer(self.tensors[src], self.tensors[dst], src_indices, dst_indices, item_size)

    def all_layer_lf_pf(self, src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, **_):
        d = byte_rows(dst)
        if d.shape[1] != dst_layout_dim:
            raise AssertionError(f"row size {d.shape[1]} != {dst_layout_dim}")
        for layer, src in enumerate(src_layers.tolist()[:num_layers]):
            d[dst_indices.long(), layer * item_size : (layer + 1) * item_size] = byte_rows(self.tensors[src])[
                src_indices.long()
            ]


def register_pools(table: _PointerTable, device_pools: list[Any], host_pool_group: Any) -> None:
    """Put the device pools' buffers and a HiCache host pool group's tensors in ``table``, where the stood-in all-layer
    ops resolve the pointers upstream's controller hands them."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv_host = host_pool_group.anchor_entry.host_pool
    indexer_host = host_pool_group.get_pool(PoolName.INDEXER)
    native = getattr(kv_host, "host_pool", kv_host)  # inside the owner-sharded wrapper, when there is one
    table.add([b for p in device_pools for b in (*p.kv_buffer, *p.index_k_with_scale_buffer)] + list(native.data_refs))
    table.add(list(getattr(indexer_host, "index_k_data_refs", None) or []))


@contextlib.contextmanager
def cpu_host_transfers() -> Iterator[_PointerTable]:
    """Upstream's host pinning and MLA transfer ops stood in on CPU (module docstring), restored on exit. Yields the
    pointer table the all-layer ops resolve through (:class:`HostTier` registers its pools' tensors in it)."""
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.pool_host import dsa as dsa_host
    from sglang.srt.mem_cache.pool_host import mla as mla_host

    table = _PointerTable()
    ops = {
        "transfer_kv_per_layer_mla": table.per_layer,
        "transfer_kv_per_layer_mla_pf_lf": table.per_layer_pf_lf,
        "transfer_kv_all_layer_mla": table.all_layer,
        "transfer_kv_all_layer_mla_lf_pf": table.all_layer_lf_pf,
    }
    saved = [(common, "_cuda_host_register", common._cuda_host_register)]
    common._cuda_host_register = lambda *args, **kwargs: None
    saved.append((torch.cpu.Stream, "synchronize", getattr(torch.cpu.Stream, "synchronize", None)))
    torch.cpu.Stream.synchronize = lambda stream: None  # CPU work is done when it returns
    for module in (mla_host, dsa_host):
        for name, op in ops.items():
            saved.append((module, name, getattr(module, name, None)))
            setattr(module, name, op)
    try:
        yield table
    finally:
        for module, name, value in saved:
            if value is None:
                delattr(module, name)
            else:
                setattr(module, name, value)


class LayerWithheld(RuntimeError):
    """A read of a layer whose load :class:`LayerLoadGate` holds back."""


class LayerLoadGate:
    """Stands in for the controller's ``LayerDoneCounter`` on the pool: a load's rows land in the pool layer by layer,
    each when a reader awaits that layer (``wait_until``), as they would on a GPU when the counter's event of the layer
    completes; a reader that does not await a layer reads what the pool held before the load. ``withhold`` makes the
    wait for a layer raise :class:`LayerWithheld` instead. ``awaited`` lists the layers waited for, in order."""

    def __init__(self, landing: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]) -> None:
        self.landing = landing  # layer -> (pool buffer, rows, the loaded bytes of those rows)
        self.awaited: list[int] = []
        self.withhold: set[int] = set()
        self.consumer_index = 0  # a load is being consumed (upstream's readers of some pools test it before waiting)

    def wait_until(self, layer: int) -> None:
        if layer in self.withhold:
            raise LayerWithheld(f"layer {layer} is withheld")
        self.awaited.append(layer)
        for buffer, rows, loaded in self.landing.pop(layer, []):
            byte_rows(buffer)[rows] = loaded


class HostTier:
    """Upstream's HiCache host tier of ``world``'s pool: its host pool group and controller (kernel I/O, host memory
    mode ``cache``, ``mem_layout``), with the index-K pool following the KV pool's transfers."""

    def __init__(
        self, world: Any, table: _PointerTable, mem_layout: str, write_policy: str = "write_through", drafts=()
    ) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
        from sglang.srt.runtime_context import get_memory

        pool = world.pool
        self.pool, self.drafts = pool, tuple(d.pool for d in drafts)
        self.allocator = world.allocator or _paged_allocator(pool)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=world.runner.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=pool.page_size,
            mtp_draft_device_pools=self.drafts,
        )
        memory = dict(
            hicache_mem_layout=mem_layout,
            hicache_ratio=2.0,
            hicache_size=0,
            hicache_io_backend="kernel",
            hicache_write_policy=write_policy,
            hicache_host_memory_mode="cache",
        )
        with get_memory().override(**memory):  # the strategy upstream's cache picks for a DSA pool, as it builds it
            built = hybrid_pool_assembler._DsaStrategy().build(
                cache=None, kvcache=pool, params=params, server_args=None, load_cache_event=threading.Event()
            )
        self.controller = built.cache_controller
        register_pools(table, [pool, *self.drafts], built.host_pool_group)

    @staticmethod
    def _index_k_follows_kv() -> list:
        """The indexer's transfer, on the KV transfer's rows (a new one per operation: the controller resolves it in
        place)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        return [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]

    @property
    def sharded(self) -> bool:
        return bool(self.controller.is_kv_sharded)

    def back_up(self, device_locs: torch.Tensor, start_owner: int | None) -> torch.Tensor:
        """Write the pages of ``device_locs`` (token locations, the tree's numbering) to host; the host locations."""
        host = self.controller.write(device_locs, start_owner=start_owner, extra_pools=self._index_k_follows_kv())
        if host is None:
            raise AssertionError("the host pool had no room for the backup")
        for ack in self.controller.ack_write_queue:
            ack.finish_event.synchronize()
        self.controller.ack_write_queue.clear()
        return host

    def load_back(self, host_locs: torch.Tensor) -> tuple[torch.Tensor, LayerLoadGate]:
        """Load ``host_locs`` into device pages the controller allocates; the device locations and the gate through
        which each layer's rows land in the pool when awaited (registered on the pool as its layer counter). A
        draft's rows land with the target's layer 0 (upstream: packed draft loads finish before target layer 0 is
        ready)."""
        target = [*enumerate(self.pool.kv_buffer), *enumerate(self.pool.index_k_with_scale_buffer)]
        drafts = [(0, b) for d in self.drafts for b in (*d.kv_buffer, *d.index_k_with_scale_buffer)]
        # (the layer whose wait lands it, buffer); an IndexShare layer's index-K pool has no rows
        held = [(layer, buffer) for layer, buffer in target + drafts if buffer.numel()]
        before = [byte_rows(buffer).clone() for _, buffer in held]
        device = self.controller.load(host_locs, extra_pools=self._index_k_follows_kv())
        if device is None:
            raise AssertionError("no device pages for the load-back")
        self.controller.start_loading()  # on CPU the copies run now; the gate holds them back per layer
        landing: dict[int, list] = {}
        for (layer, buffer), old in zip(held, before):
            landing.setdefault(layer, []).append(_held_back(buffer, old))
        gate = LayerLoadGate(landing)
        self.pool.register_layer_transfer_counter(gate)
        return device, gate


def _held_back(buffer: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``buffer`` the load changed, with their loaded bytes; the buffer put back as it was before."""
    rows = byte_rows(buffer)
    changed = (rows != before).any(dim=1).nonzero().flatten()
    loaded = rows[changed].clone()
    rows[changed] = before[changed]
    return buffer, changed, loaded


def _paged_allocator(pool: Any) -> Any:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(
        pool.size, pool.page_size, torch.int64, str(pool.kv_buffer[0].device), pool, need_sort=False
    )
