"""TEST-ONLY: an import-only stand-in for upstream's ``sgl_kernel`` (the sglang-kernel package).

Never part of the image or of serving. It exists for the GPU *test* environment that
``scripts/gpu_env/install.sh`` builds on a machine where the 373 MB sglang-kernel wheel cannot be
carried: there the pinned upstream sglang is installed from carried wheels, and many of its modules
import names from ``sgl_kernel`` at module level without calling them on the paths our CUDA tests
run (the DSA pools, upstream's JIT index-K store, the ``triton_sparse_mla`` prefill).

:func:`install` puts a meta-path finder first on ``sys.meta_path`` that serves ``sgl_kernel`` and
every ``sgl_kernel.*`` submodule as an empty package whose attributes are placeholders, so
``import sgl_kernel`` and ``from sgl_kernel.foo.bar import baz`` succeed. A placeholder's
attributes are placeholders too, but **calling any placeholder raises**
:class:`SglKernelStandinError`, naming the function and this module: a test that reaches a real
sgl_kernel kernel fails loudly instead of computing nothing. ``sgl_kernel_npu`` and other names
that merely start with ``sgl_kernel`` are not served.

The install script activates it in every interpreter of that environment through a ``.pth`` file in
its target directory (see ``scripts/gpu_env/install.sh``); :data:`ENV_MARKER` is set while it is
active so test logs can say so. Where a real ``sgl_kernel`` is importable, :func:`install` leaves it
alone and returns False.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

from sglang_cpkv.envs import envs

PACKAGE = "sgl_kernel"
ENV_MARKER = envs.SGLANG_CPKV_SGL_KERNEL_STANDIN.name
_HINT = (
    "it is the import-only TEST stand-in (sglang_cpkv.testing.sgl_kernel_standin, put on the path by "
    "scripts/gpu_env/install.sh): the real sgl_kernel (sglang-kernel) is not installed here, so code that "
    "calls it cannot run in this environment"
)


class SglKernelStandinError(RuntimeError):
    """A placeholder of the stand-in was called (or used as a real object)."""


def _served(fullname: str) -> bool:
    return fullname == PACKAGE or fullname.startswith(PACKAGE + ".")


class Placeholder:
    """A name imported from the stand-in: attribute access gives more placeholders, calling raises."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str):
        object.__setattr__(self, "_qualname", qualname)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise SglKernelStandinError(f"{self._qualname}(...) was called, but {_HINT}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in placeholder {self._qualname}>"


class StandinModule(types.ModuleType):
    """``sgl_kernel`` or one of its submodules, served empty; unknown attributes are placeholders."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = Placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel`` and ``sgl_kernel.*`` (any depth) as :class:`StandinModule` packages."""

    def find_spec(self, fullname, path, target=None):
        if _served(fullname):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandinModule(spec.name, f"sglang-cpkv TEST stand-in for {spec.name}: {_HINT}")
        module.__path__ = []
        module.__sglang_cpkv_standin__ = True
        return module

    def exec_module(self, module):
        pass


def is_active() -> bool:
    return any(isinstance(f, StandinFinder) for f in sys.meta_path)


def install() -> bool:
    """Serve ``sgl_kernel`` from the stand-in unless a real one is importable. Idempotent.

    Returns True when the stand-in is active afterwards.
    """
    if is_active():
        return True
    if PACKAGE in sys.modules or importlib.machinery.PathFinder.find_spec(PACKAGE) is not None:
        return False
    sys.meta_path.insert(0, StandinFinder())
    os.environ[ENV_MARKER] = "1"
    return True


def uninstall() -> None:
    """Remove the finder and every module it served (tests use this to leave no trace)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, StandinFinder)]
    for name in [n for n, m in sys.modules.items() if _served(n) and getattr(m, "__sglang_cpkv_standin__", False)]:
        del sys.modules[name]
    os.environ.pop(ENV_MARKER, None)
