"""Count the host reads of tensor values that sglang_cpkv's serving code makes (a test instrument).

On a GPU each such read (``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor, ``.cpu()``, ``.numpy()``)
of a device tensor is a host synchronization. :class:`HostReadCounter` is a ``TorchFunctionMode`` that records
every one whose direct caller (the first frame outside torch) is a module of ``sglang_cpkv`` other than
``sglang_cpkv.testing``, by ``module:function``: run the serving path on CPU under it to count what would
synchronize on a GPU, phase by phase (plan build, each layer).
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
_TESTING = os.path.join(_PACKAGE, "testing")
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class HostReadCounter(TorchFunctionMode):
    """``with HostReadCounter() as reads: ...`` then ``reads.counts``: ``Counter`` of ``module:function``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            frame = sys._getframe(1)
            while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH):
                frame = frame.f_back
            path = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
            if path.startswith(_PACKAGE) and not path.startswith(_TESTING):
                module = os.path.relpath(path, _PACKAGE).removesuffix(".py").replace(os.sep, ".")
                self.counts[f"{module}:{frame.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))
