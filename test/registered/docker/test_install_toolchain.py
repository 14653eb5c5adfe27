"""docker/install.sh checks every build tool before it changes anything (issue 54: it checked nvcc only).

The CUDA ops' AOT build needs nvcc, ninja (torch's extension builder runs it from PATH; a ``pip install ninja`` in
the target environment counts) and a C++ compiler (torch's ``$CXX``, else ``c++``); the plan's host layout, built
with or without the kernels, needs ``$CXX``, else ``g++``. Each missing one is refused by name before the script
installs anything. The script runs for real, with a PATH holding only stand-ins of the tools (none of them runs
before the checks), and ``--sglang-root`` naming no directory, so that a run past the checks stops at once.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
INSTALL = REPO / "docker" / "install.sh"
SYSTEM_TOOLS = ("dirname", "mktemp", "rm")  # what the script runs before and just after its checks


def run_install(tmp_path: Path, tools: set[str], *args: str, ninja_beside_python: bool = False):
    """install.sh with only ``tools`` (stand-ins) and the system tools on PATH, its target a venv-like directory."""
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    for directory in (bin_dir, venv_bin):
        directory.mkdir(parents=True, exist_ok=True)
    for tool in SYSTEM_TOOLS:
        (bin_dir / tool).symlink_to(next(Path(d, tool) for d in ("/usr/bin", "/bin") if Path(d, tool).exists()))
    for tool in tools:
        stand_in = bin_dir / tool
        stand_in.write_text("#!/bin/sh\nexit 0\n")
        stand_in.chmod(0o755)
    python = venv_bin / "python3"
    python.symlink_to(sys.executable)
    if ninja_beside_python:  # `pip install ninja` in the target environment
        (venv_bin / "ninja").write_text("#!/bin/sh\nexit 0\n")
        (venv_bin / "ninja").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "CUDA_HOME": str(tmp_path / "no-cuda")}
    argv = ["/bin/bash", str(INSTALL), "--python", str(python), "--sglang-root", str(tmp_path / "no-sglang"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("tools", "args", "refusal"),
    [
        ({"c++", "g++"}, [], "nvcc not found"),
        ({"nvcc", "c++", "g++"}, [], "ninja not found"),
        ({"nvcc", "ninja", "g++"}, [], "C++ compiler c++ not found"),
        ({"nvcc", "ninja", "c++"}, [], "C++ compiler g++ not found"),
        ({"c++"}, ["--no-kernels"], "C++ compiler g++ not found"),
    ],
    ids=["nvcc", "ninja", "torch-cxx", "host-layout-cxx", "host-layout-cxx-no-kernels"],
)
def test_a_missing_build_tool_is_refused_by_name_before_anything_changes(tmp_path, tools, args, refusal):
    done = run_install(tmp_path, tools, *args)
    assert done.returncode == 1, done.stderr
    assert f"[install] error: {refusal}" in done.stderr, done.stderr
    assert "target:" not in done.stderr and "installing" not in done.stderr  # nothing after the checks ran


@pytest.mark.parametrize("ninja_beside_python", [False, True], ids=["ninja-on-path", "ninja-in-the-target-venv"])
def test_with_every_tool_the_checks_pass(tmp_path, ninja_beside_python):
    tools = {"nvcc", "c++", "g++"} | (set() if ninja_beside_python else {"ninja"})
    done = run_install(tmp_path, tools, ninja_beside_python=ninja_beside_python)
    # Past the checks, the next step refuses the --sglang-root that names no directory.
    assert done.returncode != 0 and "not found" not in done.stderr, done.stderr
    assert "no-sglang" in done.stderr, done.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
