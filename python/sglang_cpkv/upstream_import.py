"""Import upstream sglang's modules on a machine without torchvision (the capacity planner, the P/D start-up check).

Upstream's ``srt/configs/__init__.py`` imports torchvision through a multimodal config, and a real torchvision
cannot be installed beside the CPU torch build (it replaces torch with a CUDA build). :func:`install_torchvision_stub`
installs a meta-path finder that serves ``torchvision*`` as empty modules whose attributes are inert placeholders,
with a version string (transformers probes it), unless a real torchvision is importable. Nothing that runs here
calls into torchvision. This module never imports sglang itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from unittest import mock

TORCHVISION_STUB_VERSION = "0.29.1"  # the release paired with upstream's torch pin


class _TorchvisionStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = TORCHVISION_STUB_VERSION
        return module

    def exec_module(self, module):
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def install_torchvision_stub() -> None:
    """Serve ``torchvision`` as a stub unless a real one is importable. Idempotent."""
    if any(isinstance(f, _TorchvisionStubFinder) for f in sys.meta_path):
        return
    if importlib.machinery.PathFinder.find_spec("torchvision") is not None:
        return
    sys.meta_path.insert(0, _TorchvisionStubFinder())
