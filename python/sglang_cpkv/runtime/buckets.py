"""The dense layout's rounding: how many dense slots a batch's views get, so that shapes repeat.

The dense layout (contract, "dense layout"; :mod:`.plan`) is a history region, one slot per distinct page the batch
reads history from, then each request's own slots (the pages it writes, and history pages another request of the
batch writes), so a batch needs ``plan.needed_slots`` slots. Its dense views and the plan's per-slot tensors get
:func:`round_dense_slots` of that many: the count
rounded up to a multiple of ``2 ** max(0, bit_length(slots) - 6)``, i.e. to one of 32 steps per
power of two. Batches of similar size then share shapes (CUDA-graph capture, allocator reuse), and
the rounding adds less than 1/32 (3.2%) of the slots the batch needs (:data:`MAX_ROUNDING`), and
nothing below 64 slots.
"""

from __future__ import annotations

STEPS_PER_OCTAVE_BITS = 5  # 32 sizes per power of two
MAX_ROUNDING = 1 / (1 << STEPS_PER_OCTAVE_BITS)  # extra slots / needed slots, at most


def round_dense_slots(slots: int) -> int:
    """The dense slots a batch that needs ``slots`` gets (at least 1, see the module docstring)."""
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    if slots == 0:
        return 1
    granule = 1 << max(0, slots.bit_length() - 1 - STEPS_PER_OCTAVE_BITS)
    return -(-slots // granule) * granule
