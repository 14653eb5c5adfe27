"""The development requirements resolve on the default package index alone, as on a plain machine.

scripts/setup_env.sh needs nothing but PyPI: where the PyTorch CPU index is not reachable it installs
PyPI's torch (the CUDA build), which pins its own triton, so requirements/dev-cpu.txt must agree with
it. This runs pip's own resolver (``pip install --isolated --dry-run --ignore-installed``) against PyPI
with no configuration file (``PIP_CONFIG_FILE=/dev/null``), no ``PIP_*`` variable and no find-links,
so no wheel folder, local index or installed package of this machine can make it pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
REQUIREMENTS = REPO / "requirements" / "dev-cpu.txt"
CONSTRAINTS = REPO / "requirements" / "constraints-cpu.txt"
INDEX = "https://pypi.org/simple"
FILES_HOST = "https://files.pythonhosted.org/"


def _exact_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            if exact:
                pins[canonicalize_name(req.name)] = exact[0]
    return pins


@pytest.fixture(scope="module")
def resolution(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """``name -> pip's report entry`` of what a plain machine would install."""
    try:
        urllib.request.urlopen(f"{INDEX}/pip/", timeout=30).close()
    except OSError as exc:
        pytest.fail(
            f"the default package index {INDEX} is unreachable ({getattr(exc, 'reason', exc)}): this check resolves "
            "the requirement files on it, so it needs network access to PyPI (CI has it)",
            pytrace=False,
        )
    report = tmp_path_factory.mktemp("resolve") / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--isolated",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--disable-pip-version-check",
        "--index-url",
        INDEX,
        "--timeout",
        "30",
        "--retries",
        "3",
        "--report",
        str(report),
        "-r",
        str(REQUIREMENTS),
        "-c",
        str(CONSTRAINTS),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, (
        f"{REQUIREMENTS.relative_to(REPO)} does not resolve on {INDEX} alone:\n{proc.stderr[-4000:]}"
    )
    return {canonicalize_name(i["metadata"]["name"]): i for i in json.loads(report.read_text())["install"]}


def test_every_package_comes_from_the_default_index(resolution: dict[str, dict]) -> None:
    elsewhere = {name: i["download_info"]["url"] for name, i in resolution.items()}
    elsewhere = {name: url for name, url in elsewhere.items() if not url.startswith(FILES_HOST)}
    assert not elsewhere, f"resolved from outside {INDEX}: {elsewhere}"


def test_the_pins_resolve_as_written_and_torch_takes_the_pinned_triton(resolution: dict[str, dict]) -> None:
    pins = _exact_pins(REQUIREMENTS) | _exact_pins(CONSTRAINTS)
    assert {"torch", "triton"} <= set(pins)
    resolved = {name: resolution[name]["metadata"]["version"] for name in pins}
    assert resolved == pins
    # PyPI's torch is the CUDA build, with a triton of its own: the one the file pins, not a second one.
    torch_requires = [Requirement(r) for r in resolution["torch"]["metadata"].get("requires_dist", [])]
    tritons = [
        r for r in torch_requires if canonicalize_name(r.name) == "triton" and (not r.marker or r.marker.evaluate())
    ]
    assert all(r.specifier.contains(pins["triton"]) for r in tritons), [str(r) for r in tritons]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
