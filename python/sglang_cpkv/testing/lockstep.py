"""CP ranks in one process: one thread per rank, all-gathers met at a barrier.

:class:`LockstepGroup` is a real :class:`~sglang_cpkv.runtime.CpGroup` (the runtime's collective interface) whose
ranks are threads of this process: each rank runs the same code it runs over torch.distributed
(:func:`sglang_cpkv.testing.batches.run_case_on_rank`, the harness's forwards), so thousands of CP cases run without
process start-up (the property test, the demo). The collective order is checked: a rank that gathers a different
row count than its peers fails every rank. One rank computes at a time: a rank holds the rendezvous lock while it
runs and lets it go only while it waits in a collective, so code that is not thread-safe (the Triton interpreter)
runs as it would in one process per rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

R = TypeVar("R")


class _Rendezvous:
    def __init__(self, cp_size: int) -> None:
        self.barrier = threading.Barrier(cp_size)
        self.turn = threading.Lock()  # held by the one rank that computes
        self.slots: list[torch.Tensor | None] = [None] * cp_size

    def wait(self) -> None:
        """Meet every rank at the barrier, letting the others compute meanwhile."""
        self.turn.release()
        try:
            self.barrier.wait()
        finally:
            self.turn.acquire()


class LockstepGroup:
    """Rank ``cp_rank`` of ``cp_size`` threads sharing one rendezvous."""

    def __init__(self, rendezvous: _Rendezvous, cp_size: int, cp_rank: int) -> None:
        self._rv = rendezvous
        self.cp_size = cp_size
        self.cp_rank = cp_rank

    def all_gather_rows(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rv = self._rv
        rv.slots[self.cp_rank] = local
        rv.wait()  # every rank has published its block
        blocks = list(rv.slots)
        shapes = {tuple(b.shape) for b in blocks}
        if len(shapes) != 1:
            raise RuntimeError(f"all_gather_rows: ranks gathered blocks of different shapes {sorted(shapes)}")
        gathered = torch.cat([b.to(local.device) for b in blocks])
        rv.wait()  # every rank has read the blocks before any publishes its next one
        if out is None:
            return gathered
        out.copy_(gathered)
        return out

    def all_gather_blocks(self, buffer: torch.Tensor, blocks: tuple[tuple[int, int], ...]) -> None:
        rv = self._rv
        rv.slots[self.cp_rank] = buffer
        rv.wait()  # every rank has written its block
        buffers = list(rv.slots)
        if {tuple(b.shape) for b in buffers} != {tuple(buffer.shape)}:
            raise RuntimeError(f"all_gather_blocks: ranks gathered buffers of different shapes {buffers}")
        for k, (start, count) in enumerate(blocks):
            if k != self.cp_rank:
                buffer[start : start + count] = buffers[k][start : start + count].to(buffer.device)
        rv.wait()  # every rank has read the blocks before any writes its next one


def run_lockstep(cp_size: int, rank_fn: Callable[[LockstepGroup], R]) -> list[R]:
    """``rank_fn(group)`` on ``cp_size`` threads, one :class:`LockstepGroup` rank each; results by rank.

    An exception on any rank aborts the barrier (so no rank hangs) and is re-raised here.
    """
    rv = _Rendezvous(cp_size)
    results: list = [None] * cp_size
    errors: list[BaseException | None] = [None] * cp_size

    def run(rank: int) -> None:
        with rv.turn:
            try:
                results[rank] = rank_fn(LockstepGroup(rv, cp_size, rank))
            except BaseException as exc:
                errors[rank] = exc
                rv.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,), name=f"cp-rank-{rank}") for rank in range(cp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
