"""Count the host reads of tensor values that sglang_cpkv's serving code makes (a test instrument).

On a GPU each such read (``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor, ``.cpu()``, ``.numpy()``)
of a device tensor is a host synchronization. :class:`HostReadCounter` is a ``TorchFunctionMode`` that records
every one whose direct caller (the first frame outside torch) is a module of ``sglang_cpkv`` other than its test
support (``sglang_cpkv.testing``, ``sglang_cpkv.soak``), by ``module:function``: run the serving path on CPU under it to
count what would synchronize on a GPU, phase by phase (plan build, each layer). :data:`HOST_MEMORY_READS` are the
serving code's reads of host memory (never a synchronization), which :meth:`HostReadCounter.syncs` leaves out.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../sglang_cpkv
_TEST_SUPPORT = tuple(os.path.join(_PACKAGE, name) for name in ("testing", "soak"))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


# The serving code's reads of host memory, not of data a GPU would hold: validation of host inputs (a server hands the
# plan device tensors, so on a GPU they do not run), the plan's own host staging buffer as it writes it, and the
# previous batch's error counter, read from its pinned host copy once the copy's event has completed.
HOST_MEMORY_READS = frozenset(
    {
        "runtime.plan:_validate_host_ids",
        "runtime.plan:_validate_host_locations",
        "runtime.plan:page_ids",  # numpy of a host page table (``.numpy()`` refuses a device tensor; numpy layout)
        "runtime.plan:fill",  # numpy of the host staging buffer it writes (before the one copy to the device)
        "ops.errors:describe_errors",
    }
)


class HostReadCounter(TorchFunctionMode):
    """``with HostReadCounter() as reads: ...`` then ``reads.counts``: ``Counter`` of ``module:function``.

    ``every_frame``: also count the reads whose caller is outside ``sglang_cpkv`` (upstream's), in ``others``, keyed
    ``path:function`` (the path relative to its ``site-packages``)."""

    def __init__(self, every_frame: bool = False) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.others: Counter = Counter()
        self.every_frame = every_frame

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            frame = sys._getframe(1)
            while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH):
                frame = frame.f_back
            path = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
            if path.startswith(_PACKAGE) and not path.startswith(_TEST_SUPPORT):
                module = os.path.relpath(path, _PACKAGE).removesuffix(".py").replace(os.sep, ".")
                self.counts[f"{module}:{frame.f_code.co_name}"] += 1
            elif self.every_frame and not path.startswith(_PACKAGE):
                self.others[f"{path.rpartition('site-packages' + os.sep)[2]}:{frame.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))

    def syncs(self) -> Counter:
        """The counted reads that would synchronize with a GPU (:data:`HOST_MEMORY_READS` left out)."""
        return Counter({where: n for where, n in self.counts.items() if where not in HOST_MEMORY_READS})
