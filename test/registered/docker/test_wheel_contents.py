"""The wheel (what the image installs) carries the product, not the test support.

``sglang_cpkv.testing`` (the kit driver, the GPU test environment's stand-ins), ``sglang_cpkv.harness`` and ``sglang_cpkv.soak`` stay in
the checkout: ``python/pyproject.toml`` leaves them out, and no product module imports them
(``hooks/test_hooks_import_graph.py``). Built here from a copy of ``python/`` with the environment's setuptools.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]


def test_the_wheel_leaves_test_support_out(tmp_path):
    source = tmp_path / "python"
    shutil.copytree(REPO / "python", source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("sglang_cpkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {"/".join(n.split("/")[:2]) for n in names if n.startswith("sglang_cpkv/")}
    assert not {p for p in packages if p.split("/")[1] in ("testing", "harness", "soak")}, packages
    for needed in ("sglang_cpkv/ops", "sglang_cpkv/hooks", "sglang_cpkv/pd_launch", "sglang_cpkv/upstream_import.py"):
        assert needed in packages, needed
    assert any(n.endswith(".cu") for n in names)  # the CUDA sources the image's AOT build reads
    assert not [n for n in names if n.endswith(".so")], names


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
