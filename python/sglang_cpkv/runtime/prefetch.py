"""Layer-ahead prefetch of history materialization (double-buffered dense views).

While layer ``l`` computes, the history of layer ``l + 1`` is materialized into the other of
two dense buffers, from the same per-batch plan. On a GPU the copies (and, under CP, the page
all-gather) run on a side CUDA stream and an event orders them before the consumer; on CPU the
prefetch runs synchronously at :meth:`HistoryPrefetcher.start`.

Usage per batch (``pools[l]`` is layer ``l``'s pool)::

    prefetcher = HistoryPrefetcher(plan, group, buffers=(dense_a, dense_b))
    prefetcher.start(0, pools[0])
    for l in range(num_layers):
        dense = prefetcher.wait(l)            # history of layer l is in `dense`
        if l + 1 < num_layers:
            prefetcher.start(l + 1, pools[l + 1])
        fill_current(plan, current_kv[l], dense)
        ...                                   # attention reads dense via remap_topk(...)

A buffer is reused two layers later; :meth:`wait` of layer ``l`` must come after the consumer of
layer ``l - 2`` was enqueued on the current stream (the loop above guarantees it: the side stream
waits for the current stream before it writes a buffer).
"""

from __future__ import annotations

import torch

from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime.group import CpGroup
from sglang_cpkv.runtime.layer import materialize_history
from sglang_cpkv.runtime.plan import CpSharedKvPlan


class HistoryPrefetcher:
    """Double-buffered, layer-ahead history materialization for one batch.

    Args:
        plan: the batch plan (the same for every layer).
        group: the CP group (all ranks must start the same layers in the same order).
        buffers: two dense views ``[R * P * page_size, row...]`` of one dtype and shape.
        stream: the side CUDA stream to run on (default: a new one). Prefetchers whose collectives
            share one communicator must share one stream, so that their all-gathers run in the
            order they were started on every rank.
    """

    def __init__(
        self,
        plan: CpSharedKvPlan,
        group: CpGroup,
        buffers: tuple[torch.Tensor, torch.Tensor],
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        if len(buffers) != 2 or buffers[0].shape != buffers[1].shape or buffers[0].dtype != buffers[1].dtype:
            raise CpSharedKvError("HistoryPrefetcher needs two dense buffers of one shape and dtype")
        if buffers[0].data_ptr() == buffers[1].data_ptr():
            raise CpSharedKvError("HistoryPrefetcher buffers must be distinct tensors")
        self.plan = plan
        self.group = group
        self.buffers = buffers
        self._on_cuda = buffers[0].is_cuda
        if not self._on_cuda:
            self._stream = None
        else:
            self._stream = stream if stream is not None else torch.cuda.Stream(device=buffers[0].device)
        self._events: dict[int, torch.cuda.Event] = {}
        self._started: set[int] = set()

    def start(self, layer: int, pool: torch.Tensor) -> None:
        """Begin materializing ``layer``'s history from its ``pool`` into buffer ``layer % 2``."""
        if layer in self._started:
            raise CpSharedKvError(f"prefetch of layer {layer} already started")
        dense = self.buffers[layer % 2]
        if self._stream is None:
            materialize_history(self.plan, pool, dense, self.group)
        else:
            # The side stream must not overwrite the buffer before earlier reads on the current stream.
            self._stream.wait_stream(torch.cuda.current_stream(dense.device))
            with torch.cuda.stream(self._stream):
                materialize_history(self.plan, pool, dense, self.group)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[layer] = event
            pool.record_stream(self._stream)
            dense.record_stream(self._stream)
        self._started.add(layer)

    def wait(self, layer: int) -> torch.Tensor:
        """The dense view holding ``layer``'s history, ordered after its prefetch on the current stream."""
        if layer not in self._started:
            raise CpSharedKvError(f"wait for layer {layer} before its prefetch was started")
        self._started.discard(layer)
        event = self._events.pop(layer, None)
        if event is not None:
            torch.cuda.current_stream(self.buffers[0].device).wait_event(event)
        return self.buffers[layer % 2]
