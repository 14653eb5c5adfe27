"""Build the CP shared-KV CUDA library (``sgl-kernel/csrc/cp_shared_kv``): JIT for development, AOT for the image.

Both builds find the sources as package data (``sglang_cpkv/csrc``). JIT (:func:`jit_build`, only under
``SGLANG_CPKV_CUDA_JIT=1``, from :mod:`sglang_cpkv.ops.cuda`): for the visible GPU, once, cached under
``SGLANG_CPKV_CUDA_CACHE`` (default ``$XDG_CACHE_HOME/sglang_cpkv/cuda``, else ``~/.cache/sglang_cpkv/cuda``) by the
sources' hash, the torch version and the arch. AOT (``docker/install.sh``) writes ``sglang_cpkv_cuda.so`` and a
``.json`` of its sources' hash, torch version and archs; serving loads it from ``SGLANG_CPKV_CUDA_LIB`` (the ``.so``
or its directory) or ``sglang_cpkv/ops/prebuilt/``, and refuses one built from other sources or another torch:

    python -m sglang_cpkv.ops.cuda_build --aot --arch 90a,100a,103a --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sglang_cpkv.envs import environment, envs

LIBRARY_NAME = "sglang_cpkv_cuda"
LIB_ENV = envs.SGLANG_CPKV_CUDA_LIB.name
JIT_ENV = envs.SGLANG_CPKV_CUDA_JIT.name
CACHE_ENV = envs.SGLANG_CPKV_CUDA_CACHE.name
# Compiled sources, in link order; headers (*.h, *.cuh) are hashed too.
SOURCES = (
    "build_page_inverse.cu",
    "remap_locs.cu",
    "current_dense_locs.cu",
    "copy_pages.cu",
    "scatter_rows.cu",
    "materialize_and_fill.cu",
    "torch_bindings.cc",
)
BUILD_INPUT_SUFFIXES = (".cu", ".cuh", ".h", ".cc")
# The image's targets: Hopper (H100/H200) and Blackwell (B200/B300).
DEFAULT_AOT_ARCHS = ("90a", "100a", "103a")
CUDA_CFLAGS = ("-O3", "-lineinfo")
CXX_CFLAGS = ("-O3",)

logger = logging.getLogger(__name__)


def source_dir() -> Path:
    """Directory of the packaged CUDA sources (raises :class:`FileNotFoundError` naming it when absent)."""
    path = Path(str(importlib.resources.files("sglang_cpkv") / "csrc" / "cp_shared_kv"))
    missing = [name for name in SOURCES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"CUDA sources of sglang_cpkv not found in {path} (missing {', '.join(missing)}): the package was installed without its csrc package data"
        )
    return path


def source_hash() -> str:
    """sha256 over the names and bytes of every build input, so any edit gives a new JIT cache entry."""
    digest = hashlib.sha256()
    root = source_dir()
    for path in sorted(p for p in root.iterdir() if p.suffix in BUILD_INPUT_SUFFIXES):
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _cache_root() -> Path:
    configured = envs.SGLANG_CPKV_CUDA_CACHE.get()
    if configured:
        return Path(configured)
    base = envs.XDG_CACHE_HOME.get() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang_cpkv" / "cuda"


def _torch_arch_list(archs: list[str]) -> str:
    """``["90a", "100a"]`` -> ``"9.0a;10.0a"`` (the TORCH_CUDA_ARCH_LIST spelling)."""
    out = []
    for arch in archs:
        digits, suffix = (arch[:-1], "a") if arch.endswith("a") else (arch, "")
        if not digits.isdigit() or len(digits) < 2:
            raise ValueError(f"arch must look like 90a or 100a, got {arch!r}")
        out.append(f"{digits[:-1]}.{digits[-1]}{suffix}")
    return ";".join(out)


def _compile(build_dir: Path, verbose: bool) -> Path:
    """Compile and link the sources into ``build_dir``; loads the library into this process; returns its path."""
    from torch.utils import cpp_extension

    src = source_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    path = cpp_extension.load(
        name=LIBRARY_NAME,
        sources=[str(src / name) for name in SOURCES],
        extra_cflags=list(CXX_CFLAGS),
        extra_cuda_cflags=list(CUDA_CFLAGS),
        extra_include_paths=[str(src)],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    return Path(path)


def jit_library_path() -> Path:
    """Where :func:`jit_build` puts the library for this source tree, torch version and GPU."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    key = f"{source_hash()[:16]}-torch{torch.__version__.replace('+', '_')}-sm{major}{minor}"
    return _cache_root() / key / f"{LIBRARY_NAME}.so"


def jit_build(verbose: bool = False) -> Path:
    """Build (once) and load the library for the visible GPU; returns its path. Development only."""
    import torch

    path = jit_library_path()
    if path.is_file():
        torch.ops.load_library(str(path))
        return path
    logger.warning(
        "sglang_cpkv: JIT-building the CUDA ops into %s (once per source change; about a minute)", path.parent
    )
    start = time.monotonic()
    built = _compile(path.parent, verbose)
    logger.warning("sglang_cpkv: CUDA ops built in %.0f s", time.monotonic() - start)
    return built


def aot_build(out_dir: Path, archs: list[str], verbose: bool = False) -> Path:
    """Build the library for ``archs`` into ``out_dir`` with its metadata; returns the ``.so`` path.

    Runs where torch with CUDA and nvcc are installed (no GPU needed); the image runs it once.
    """
    import torch

    if not archs:
        raise ValueError("aot_build needs at least one arch, e.g. 90a")
    with (
        environment({"TORCH_CUDA_ARCH_LIST": _torch_arch_list(archs)}),
        tempfile.TemporaryDirectory(prefix="sglang_cpkv_aot_") as tmp,
    ):
        logger.warning("sglang_cpkv: AOT-building the CUDA ops for %s", ", ".join(archs))
        start = time.monotonic()
        built = _compile(Path(tmp), verbose)
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / f"{LIBRARY_NAME}.so"
        shutil.copyfile(built, target)
    metadata = {"source_hash": source_hash(), "torch_version": torch.__version__, "archs": list(archs)}
    (out_dir / f"{LIBRARY_NAME}.json").write_text(json.dumps(metadata, indent=2) + "\n")
    logger.warning("sglang_cpkv: wrote %s in %.0f s", target, time.monotonic() - start)
    return target


def prebuilt_library() -> Path | None:
    """The prebuilt library serving should load: ``$SGLANG_CPKV_CUDA_LIB``, else the package's ``ops/prebuilt/``."""
    configured = envs.SGLANG_CPKV_CUDA_LIB.get()
    if configured:
        path = Path(configured)
        return path / f"{LIBRARY_NAME}.so" if path.is_dir() else path
    packaged = Path(__file__).resolve().parent / "prebuilt" / f"{LIBRARY_NAME}.so"
    return packaged if packaged.is_file() else None


def stale_reason(library: Path) -> str | None:
    """Why the prebuilt ``library`` must not be loaded here (None when it matches these sources and torch)."""
    import torch

    meta_path = library.with_suffix(".json")
    if not meta_path.is_file():
        return f"{meta_path} (written by the AOT build next to the library) is missing"
    metadata = json.loads(meta_path.read_text())
    if metadata.get("torch_version") != torch.__version__:
        return f"{library} was built for torch {metadata.get('torch_version')}, this process runs torch {torch.__version__}"
    try:
        current = source_hash()
    except FileNotFoundError as exc:
        return str(exc)
    if metadata.get("source_hash") != current:
        return f"{library} is stale: built from sources {str(metadata.get('source_hash'))[:12]}, the package holds {current[:12]}; rebuild it"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aot", action="store_true", help="ahead-of-time build for --arch into --out")
    parser.add_argument("--arch", default=",".join(DEFAULT_AOT_ARCHS), help="comma-separated archs, e.g. 90a,100a,103a")
    parser.add_argument("--out", type=Path, help="output directory of the AOT build")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.aot:
        if args.out is None:
            parser.error("--aot needs --out DIR")
        print(aot_build(args.out, [a.strip() for a in args.arch.split(",") if a.strip()], args.verbose))
    else:
        print(jit_build(args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
