"""Import upstream sglang modules on a CPU test machine.

The patched upstream modules we test (``layers/deep_gemm_wrapper/compile_utils.py``,
``layers/attention/dsa_backend.py``, ``layers/cp``, ``mem_cache/*``) reach
``srt/configs/__init__.py``, which imports torchvision through a multimodal config. A real
torchvision cannot be installed beside the CPU torch build (it replaces torch with a CUDA build),
so tests install :func:`install_torchvision_stub` first: a meta-path finder that serves
``torchvision*`` as empty modules whose attributes are inert placeholders, with a version string
(transformers probes it). Nothing we test calls into torchvision.

Only tests use this module; it never imports sglang itself.
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


def set_cp_shared_kv_flag(on: bool) -> None:
    """Set ``--enable-cp-shared-kv`` on the server args published in this process (what the hooks read).

    Tests of the hooks at cp = 1 need the flag where a real server would refuse it (start-up validation
    asks for prefill CP), so it is written onto the published record directly, past its strict setter.
    """
    import msgspec
    from sglang.srt.runtime_context import get_server_args

    msgspec.Struct.__setattr__(get_server_args(), "enable_cp_shared_kv", on)
