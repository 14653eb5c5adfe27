"""The plan's host layout, compiled: ``csrc/cp_shared_kv_host/plan_layout.cc`` loaded with ctypes.

The dense layout of a batch and its staging buffer are host work on every batch; in numpy they are some forty calls
(a few microseconds each; about half of the mode's per-batch host cost at 64 requests). The compiled layout makes
the same arrays in a few linear passes and writes the staging buffer in place. :mod:`.plan`'s numpy functions are its
reference: the tests compare every staged byte, and the plan uses them where the library is not built (logged once).

The library is plain C++ (no torch, no Python headers), built once per source by :mod:`.host_layout_build`; its file
name carries the source's hash, so a library built from other sources is never loaded. Nothing is compiled on the
serving path.
"""

from __future__ import annotations

import array
import ctypes
import functools
import itertools
import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

# cpkv_plan_layout's sizes output, in the order of plan_layout.cc's Size enum.
SIZE_FIELDS = ("entries", "region", "own", "pool_copies", "view_copies", "bad_request", "layout_id")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) when it is not built for these sources."""
    # Imported here, so that `python -m sglang_cpkv.runtime.host_layout_build` is not imported by the package first.
    from sglang_cpkv.runtime.host_layout_build import library_name, prebuilt_dir

    path = prebuilt_dir() / library_name()
    if not path.is_file():
        logger.warning(
            "sglang_cpkv: the plan's compiled host layout is not built (%s is missing): the plan lays batches out "
            "in numpy (slower on the host); build it with `python -m sglang_cpkv.runtime.host_layout_build`",
            path,
        )
        return None
    lib = ctypes.CDLL(str(path))
    lib.cpkv_plan_layout.restype = ctypes.c_int64
    # Arrays go as addresses (c_void_p): an int64 pointer object per array costs twice the call's own overhead.
    lib.cpkv_plan_layout.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 3]
    lib.cpkv_plan_layout.argtypes += [*[ctypes.c_int64] * 5, *[ctypes.c_void_p] * 3]
    lib.cpkv_plan_pack.restype = ctypes.c_int64
    lib.cpkv_plan_pack.argtypes = [*[ctypes.c_int64] * 3, ctypes.c_void_p]
    return lib


class CompiledLayout:
    """One batch's layout made by the library (the same attributes as :class:`~.plan._NumpyLayout`). Its staging
    reads the library's per-thread scratch: stage it on the thread that made it, before the next layout."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        table: torch.Tensor | None,
        width: int,
        prefix: Sequence[int],
        extend: Sequence[int],
        pages_needed: Sequence[int],
        *,
        page_size: int,
        cp_size: int,
        cp_rank: int,
        capacity: int,
        validate: bool,
    ):
        """``table``: the host page table (row-major, int32 or int64), or None when the page ids are not on the
        host; ``width``: its columns (the entries' cells ``r * width + j`` are staged when the ids are not on the host).
        ``prefix``, ``extend``, ``pages_needed``: per request (``plan._validate_lengths``, ``plan._pages_needed``)."""
        self._lib = lib
        num_requests = len(prefix)
        # The library reads raw int64 memory: the three per-request inputs in one buffer, the outputs (sizes, entry
        # starts, gather block counts) in another (array.array: a few microseconds where numpy arrays cost tens on
        # the batch's cold host path).
        lengths = array.array("q", [*prefix, *extend, *pages_needed])
        out = array.array("q", bytes(8 * (len(SIZE_FIELDS) + num_requests + cp_size)))
        inputs, outputs = lengths.buffer_info()[0], out.buffer_info()[0]
        address, itemsize = None, 0
        if table is not None:
            if table.device.type != "cpu":
                raise ValueError(f"the compiled host layout reads a host page table, got one on {table.device}")
            table = table.contiguous() if table.element_size() in (4, 8) else table.to(torch.int64)
            address, itemsize = table.data_ptr(), table.element_size()
        status = lib.cpkv_plan_layout(
            address,
            itemsize,
            width,
            num_requests,
            inputs,
            inputs + 8 * num_requests,
            inputs + 16 * num_requests,
            page_size,
            cp_size,
            cp_rank,
            capacity,
            int(validate),
            outputs,
            outputs + 8 * len(SIZE_FIELDS),
            outputs + 8 * (len(SIZE_FIELDS) + num_requests),
        )
        if status != 0:
            why = f"a page table of {itemsize}-byte ids" if status == -1 else f"{sum(pages_needed)} entries"
            raise RuntimeError(f"the compiled host layout refused the batch: {why} (the plan checks both before)")
        count = dict(zip(SIZE_FIELDS, out[: len(SIZE_FIELDS)]))
        self.entry_starts = tuple(out[len(SIZE_FIELDS) : len(SIZE_FIELDS) + num_requests])
        self.pages_known = table is not None
        self.num_entries = count["entries"]
        self.region_slots = count["region"]
        self.own_slots = count["own"]
        self.bad_request = count["bad_request"] if count["bad_request"] >= 0 else None
        self.gather_blocks: tuple[tuple[int, int], ...] = ()
        if cp_size > 1 and self.region_slots:
            counts = out[len(SIZE_FIELDS) + num_requests :].tolist()
            self.gather_blocks = tuple(zip(itertools.accumulate(counts, initial=0), counts))
        self._num_requests = num_requests
        self._copies = (count["pool_copies"], count["view_copies"])
        self._layout_id = count["layout_id"]

    def stage_sizes(self, num_slots: int, num_errors: int) -> tuple[list[int], list[int]]:
        """Elements of each staged int64 and int32 array (the order of :meth:`~.plan._NumpyLayout.stage_sizes`)."""
        entries, requests = self.num_entries, self._num_requests
        pool, view = self._copies
        sizes64 = [entries, requests, requests] + ([] if self.pages_known else [entries])
        sizes32 = [num_errors, entries, pool, pool, view, view] + ([entries, num_slots] if self.pages_known else [])
        return sizes64, sizes32

    def fill(self, buffer: torch.Tensor, num_slots: int, num_errors: int) -> None:
        """Write the staging into the host byte tensor ``buffer`` (sized by :meth:`stage_sizes`)."""
        written = self._lib.cpkv_plan_pack(self._layout_id, num_slots, num_errors, buffer.data_ptr())
        if written == -2:
            raise RuntimeError(
                "the compiled host layout was staged after another layout was made on this thread (or on another "
                "thread): stage a layout before making the next"
            )
        if written != buffer.numel():
            raise RuntimeError(f"the compiled host layout wrote {written} staging bytes, expected {buffer.numel()}")
