"""The CP group: the one collective the runtime needs (all-gather of equal-sized row blocks).

:class:`SingleRankGroup` serves ``cp_size = 1`` without any process group.
:class:`TorchDistCpGroup` wraps a ``torch.distributed`` process group: NCCL on GPUs
(``all_gather_into_tensor``), gloo on CPU (``all_gather`` into a list, the form gloo supports).
Tensors travel as raw bytes (``uint8`` views), so bf16 rows and the 656-byte packed FP8 rows
move bit-exactly on every backend. Callers pad to a common row count before gathering (the plan
gives every rank the same ``physical_rows`` and ``exchange_pages_per_rank``).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist


class CpGroup(Protocol):
    """What the runtime needs from a CP group."""

    cp_size: int
    cp_rank: int

    def all_gather_rows(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[cp_size * M, ...]``: every rank's ``[M, ...]`` block, rank-major. ``M`` equal on all ranks.

        ``out`` (``[cp_size * M, ...]``, the dtype of ``local``) is written and returned when given, so a
        caller reuses one buffer across layers.
        """
        ...


class SingleRankGroup:
    """``cp_size = 1``: the all-gather is the identity."""

    cp_size = 1
    cp_rank = 0

    def all_gather_rows(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return local
        out.copy_(local)
        return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``uint8 [rows, row_bytes]`` view of ``t`` (``[rows, ...]``)."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


class TorchDistCpGroup:
    """A CP group over ``torch.distributed`` (NCCL or gloo).

    Args:
        group: the process group of the CP ranks (``None``: the default group).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.cp_size = dist.get_world_size(group)
        self.cp_rank = dist.get_rank(group)
        self._gloo = dist.get_backend(group) == "gloo"

    def all_gather_rows(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = local.shape[0]
        shape = (self.cp_size * rows, *local.shape[1:])
        if out is None:
            out = local.new_empty(shape)
        elif tuple(out.shape) != shape or out.dtype != local.dtype or not out.is_contiguous():
            raise ValueError(
                f"all_gather_rows: out is {tuple(out.shape)} {out.dtype}, expected contiguous {shape} {local.dtype}"
            )
        if self.cp_size == 1:
            out.copy_(local)
            return out
        src, dst = as_bytes(local), as_bytes(out)
        if rows and src.shape[1]:
            if self._gloo:
                dist.all_gather(list(dst.chunk(self.cp_size)), src, group=self.group)
            else:
                dist.all_gather_into_tensor(dst, src, group=self.group)
        return out
