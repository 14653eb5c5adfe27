"""The CP group: the two collectives the runtime needs (:class:`~.pipeline.LayerPipeline`; the hooks' exchange group).

* :meth:`CpGroup.all_gather_rows` - equal-sized row blocks, rank-major (the current chunk).
* :meth:`CpGroup.all_gather_blocks` - in place, blocks of uneven sizes of one buffer (the history region of a dense
  view: rank ``k`` wrote its block, every rank receives every block where it belongs).

:class:`SingleRankGroup` serves ``cp_size = 1``; :class:`TorchDistCpGroup` wraps a ``torch.distributed`` group: NCCL
on GPUs (uneven blocks as a list all-gather: grouped broadcasts), gloo on CPU (one ``broadcast`` per rank for uneven
blocks, which gloo's all-gather refuses). Tensors travel as raw bytes (``uint8`` views), so bf16 and 656-byte packed
FP8 rows move bit-exactly. Design: ``docs/design/cp-shared-kv.md`` section 4.
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

    def all_gather_blocks(self, buffer: torch.Tensor, blocks: tuple[tuple[int, int], ...]) -> None:
        """In place: rows ``[start_k, start_k + count_k)`` of ``buffer`` (``[rows, ...]``, contiguous), written by
        rank ``k`` on rank ``k``, become the same rows on every rank. ``blocks`` (one per rank) is the same on
        every rank."""
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

    def all_gather_blocks(self, buffer: torch.Tensor, blocks: tuple[tuple[int, int], ...]) -> None:
        return None  # one rank: its block is already in place


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

    def all_gather_blocks(self, buffer: torch.Tensor, blocks: tuple[tuple[int, int], ...]) -> None:
        if len(blocks) != self.cp_size:
            raise ValueError(f"all_gather_blocks: {len(blocks)} blocks for {self.cp_size} ranks")
        if self.cp_size == 1 or not buffer.numel():
            return
        if not buffer.is_contiguous():
            raise ValueError("all_gather_blocks: the buffer must be contiguous (its blocks are written in place)")
        rows = as_bytes(buffer)
        parts = [rows[start : start + count] for start, count in blocks]
        if self._gloo and len({count for _, count in blocks}) > 1:
            for k, part in enumerate(parts):
                if part.shape[0]:
                    dist.broadcast(part, src=dist.get_global_rank(self.group, k) if self.group else k, group=self.group)
            return
        dist.all_gather(parts, parts[self.cp_rank], group=self.group)
