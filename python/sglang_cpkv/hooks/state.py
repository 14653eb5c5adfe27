"""The CP shared-KV mode's state in a server process, in one place: its configuration and what start-up made for it.

* :class:`ModeConfig`, frozen: the reservation (limit, chunk, page size, CP size, layer-ahead, row sizes, the
  backends it serves) and checked mode, built once where upstream sizes the KV pool
  (:func:`~.reservation.pool_overhead_bytes`) and read by every batch hook: nothing re-derives them per batch.
* What start-up made: the history exchange's process group (:mod:`.exchange_group`; a rank's place in the CP group
  is its group's) and the CP size of the page-interleave allocator the mode built (:mod:`.page_ids`).

Each piece is published by the hook that makes it; tests and the capacity planner (several servers in one process)
put the whole state back with :func:`scoped`; :func:`reset` empties it. Design: ``docs/design/cp-shared-kv.md`` 2-2b.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime.reservation import Reservation


@dataclass(frozen=True)
class ModeConfig:
    """The mode's one configuration in a server process.

    Attributes:
        reservation: the mode's buffers, sized once (its ``cp_size`` and ``layer_ahead`` are the batches' too).
        checked: checked mode (``SGLANG_CPKV_CHECKED``, :mod:`sglang_cpkv.runtime.checked`), read at start-up.
    """

    reservation: Reservation
    checked: bool


@dataclass
class ProcessState:
    """What this process holds for the mode (None: not made here, or not yet)."""

    config: ModeConfig | None = None
    exchange_group: Any = None  # runtime.group.TorchDistCpGroup, under CP
    allocator_cp: int | None = None  # the CP size of the page-interleave allocator the mode built


_state = ProcessState()


def current() -> ProcessState:
    return _state


def config() -> ModeConfig:
    """The published configuration; a batch of the mode without one is refused (the pool sizing hook did not run)."""
    if _state.config is None:
        raise CpSharedKvError(
            "the CP shared-KV buffers were not reserved at start-up (the pool configurator hook of "
            "patches/core/reserve-cp-shared-kv-buffers.patch did not run)"
        )
    return _state.config


def reset() -> None:
    """Empty the process state (as a process starts)."""
    global _state
    _state = ProcessState()


@contextmanager
def scoped(*, empty: bool = True) -> Iterator[ProcessState]:
    """Run a block in a process state of its own (empty, or a copy of the current one) and put the previous state
    back afterwards (tests, and the planner's sizing of servers)."""
    global _state
    saved = _state
    _state = ProcessState() if empty else dataclasses.replace(saved)
    try:
        yield _state
    finally:
        _state = saved
