"""Build the plan's compiled host layout (``csrc/cp_shared_kv_host/plan_layout.cc``, loaded by :mod:`.host_layout`).

    python -m sglang_cpkv.runtime.host_layout_build    # into the package's runtime/prebuilt/ (compiler: $CXX, else g++)

``scripts/setup_env.sh``, ``docker/install.sh`` and ``benchmark/gpu_validation.sh`` run it. The library's file name
carries the source's hash: a build from other sources sits beside it unused.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sglang_cpkv.env import env_text

SOURCE = "plan_layout.cc"
# The layout ranks pages in bit sets: the popcount instruction (every x86-64 CPU since 2008; without the flag the
# compiler calls a library popcount for every rank).
CXX_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    *(("-mpopcnt",) if platform.machine() in ("x86_64", "AMD64") else ()),
)


def source_path() -> Path:
    return Path(str(importlib.resources.files("sglang_cpkv") / "csrc" / "cp_shared_kv_host" / SOURCE))


def library_name() -> str:
    """The library's file name: the source's sha256 in it, so a stale build is never loaded."""
    digest = hashlib.sha256(source_path().read_bytes()).hexdigest()[:16]
    return f"libsglang_cpkv_plan_layout-{digest}.so"


def prebuilt_dir() -> Path:
    return Path(__file__).resolve().parent / "prebuilt"


def build() -> Path:
    """Compile the library into :func:`prebuilt_dir` with ``$CXX`` (else ``g++``); returns its path."""
    out_dir = prebuilt_dir()
    compiler = env_text("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"C++ compiler {compiler!r} not found (set CXX): the plan's host layout needs one")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / library_name()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # compiled aside, then renamed: a reader never sees half
        built = Path(tmp) / target.name
        subprocess.run([compiler, *CXX_FLAGS, "-o", str(built), str(source_path())], check=True)
        os.replace(built, target)
    for stale in out_dir.glob("libsglang_cpkv_plan_layout-*.so"):  # builds of other sources: never loaded
        if stale != target:
            stale.unlink()
    return target


def main(argv=None) -> int:
    argparse.ArgumentParser(description=f"Build the plan's compiled host layout into {prebuilt_dir()}.").parse_args(
        argv
    )
    path = build()
    print(f"[host_layout] built {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
