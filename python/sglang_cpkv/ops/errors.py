"""Device-side error counter shared by every CP shared-KV op.

Outside checked mode the hot path never synchronizes with the host, so an op that meets a bad id drops the element
(writes nothing, or -1) and adds one to the counter of that kind; the batch plan owns one counter and surfaces it at
the next natural sync point (:meth:`sglang_cpkv.runtime.plan.CpSharedKvPlan.raise_if_errors`, which calls
:func:`raise_if_errors`); checked mode (``SGLANG_CPKV_CHECKED=1``, :mod:`sglang_cpkv.runtime.checked`) raises after
each op. Contract: ``docs/design/cp-shared-kv-contract.md``, "Errors and synchronization".

The layout is fixed (int32 ``[NUM_ERROR_KINDS]``) because the CUDA and Triton kernels increment it with atomics at
these indices.
"""

from __future__ import annotations

import torch

# Index of each kind in the counter tensor (kernels use the same numbers).
ERR_PAGE_OUT_OF_RANGE = 0  # a page id outside [0, capacity), or twice in one request (or a page index outside src/dst)
ERR_REQ_OUT_OF_RANGE = 1  # a request id outside [0, batch_rows) other than the padding id -1
ERR_LOC_OUT_OF_RANGE = 2  # a destination row outside the destination tensor
ERR_CURRENT_LOC_MISMATCH = 3  # a current token's out_cache_loc is not its page-table location (runtime.plan)
NUM_ERROR_KINDS = 4
ERROR_NAMES = (
    "page id out of range or repeated in a request",
    "request id out of range",
    "destination row out of range",
    "current token whose out_cache_loc is not the location its page table gives it (out_cache_loc disagrees "
    "with the page table)",
)


def new_error_counter(device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 ``[NUM_ERROR_KINDS]`` counter on ``device``."""
    return torch.zeros(NUM_ERROR_KINDS, dtype=torch.int32, device=device)


class CpSharedKvError(RuntimeError):
    """Bad input met by a CP shared-KV op or plan (never a silent cross-request write)."""


def describe_errors(errors: torch.Tensor, where: str) -> str | None:
    """``"<where>: dropped bad ids: ..."`` naming every non-zero kind of the counter, None when all are zero
    (synchronizes: call only at a natural sync point, or on a host copy)."""
    bad = [f"{n} x {ERROR_NAMES[k]}" for k, n in enumerate(errors.tolist()) if n]
    return f"{where}: dropped bad ids: " + ", ".join(bad) if bad else None


def raise_if_errors(errors: torch.Tensor, where: str) -> None:
    """Synchronize, and raise :class:`CpSharedKvError` naming every non-zero kind.

    Call only at a natural sync point (or in checked mode).
    """
    message = describe_errors(errors, where)
    if message:
        raise CpSharedKvError(message)
