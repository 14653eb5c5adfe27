"""Import upstream sglang modules on a CPU test machine.

The patched upstream modules we test (``layers/deep_gemm_wrapper/compile_utils.py``,
``layers/attention/dsa_backend.py``, ``layers/cp``, ``mem_cache/*``) reach
``srt/configs/__init__.py``, which imports torchvision through a multimodal config. A real
torchvision cannot be installed beside the CPU torch build (it replaces torch with a CUDA build),
so tests install :func:`install_torchvision_stub` first: a meta-path finder that serves
``torchvision*`` as empty modules whose attributes are inert placeholders, with a version string
(transformers probes it). Nothing we test calls into torchvision.

Upstream-backed tests skip, saying why, where upstream cannot be imported (a bare GPU box, say). In the
GPU test environment (``scripts/gpu_env/install.sh``), which exports ``SGLANG_CPKV_REQUIRE_UPSTREAM=1``,
such a test must run: :func:`skip_or_fail` turns the skip into a failure there, and :func:`kit_testcase`
gives upstream's test kits (which call ``testcase.skipTest``) a test case that does the same.

Only tests and the capacity planner's CLI (a CPU tool) use this module; it never imports sglang itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import unittest
from typing import NoReturn
from unittest import mock

from sglang_cpkv.env import env_flag

TORCHVISION_STUB_VERSION = "0.29.1"  # the release paired with upstream's torch pin
REQUIRE_UPSTREAM_ENV = "SGLANG_CPKV_REQUIRE_UPSTREAM"


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


def upstream_required() -> bool:
    """Whether upstream-backed tests must run here (``SGLANG_CPKV_REQUIRE_UPSTREAM``, set by the GPU test env)."""
    return env_flag(REQUIRE_UPSTREAM_ENV)


def skip_or_fail(reason: str) -> NoReturn:
    """Skip an upstream-backed test for ``reason``; fail it instead where upstream is required."""
    import pytest

    if upstream_required():
        pytest.fail(
            f"{reason} [{REQUIRE_UPSTREAM_ENV}=1: in the GPU test environment (scripts/gpu_env/install.sh) an "
            "upstream-backed test that cannot run is a failure, not a skip]",
            pytrace=False,
        )
    pytest.skip(reason)


class _KitTestCase(unittest.TestCase):
    """The ``testcase`` upstream's kits take: unittest assertions, and ``skipTest`` through :func:`skip_or_fail`."""

    def runTest(self) -> None:  # unittest needs a method to bind; the kit calls the assertions directly
        pass

    def skipTest(self, reason) -> NoReturn:
        skip_or_fail(f"upstream's kit skipped: {reason}")


def kit_testcase() -> unittest.TestCase:
    """A test case for ``sglang.test.kits`` helpers (``run_dsa_sparse_attention_case(testcase, ...)``)."""
    return _KitTestCase()
