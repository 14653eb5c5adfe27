"""TEST-ONLY: an import-only stand-in for upstream's ``sgl_kernel`` (the sglang-kernel package).

Never part of the image or of serving. The GPU test environment (``scripts/gpu_env/install.sh``) cannot carry the
373 MB sglang-kernel wheel, yet many upstream modules import names from ``sgl_kernel`` at module level without
calling them on the paths our CUDA tests run. :func:`install` puts a meta-path finder first that serves
``sgl_kernel`` and its submodules as empty packages of placeholders; **calling any placeholder raises**
:class:`SglKernelStandinError`, naming the function, so a test that reaches a real kernel fails loudly. Other names
that start with ``sgl_kernel`` are not served, a real ``sgl_kernel`` is left alone (:func:`install` returns False),
and :data:`ENV_MARKER` is set while it is active. Activated by :mod:`.gpu_env`'s ``.pth`` file; the environment:
the contract's "Environments".
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
