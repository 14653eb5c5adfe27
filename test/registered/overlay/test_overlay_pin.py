"""The pin is the one source of truth: every copy of the version agrees with it, a rebase moves them all.

Covers the copies outside ``UPSTREAM.toml`` (docker/, python/pyproject.toml, README.md, docs/operations.md), the tomlkit
rewrite of the pin itself (comments and quoting forms kept), ``Requires-Dist`` read with packaging, and
a rebase of the real queue onto the pinned version, which must change no byte (the closure files included). Trees a test changes are
temporary copies; the repo is only read.
"""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from sglang_cpkv.overlay.pin import PIN_FILE, WheelPin, find_queue_root, load_pin
from sglang_cpkv.overlay.pin_rewrite import rewrite_pin_toml, rewrite_version_references
from sglang_cpkv.overlay.rebase import rebase
from sglang_cpkv.overlay.wheels import cache_dir, fetch_pinned, wheel_requirements
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.version_copies import SCANNED_DIRS, SCANNED_FILES, version_copies

register_cpu_ci(est_time=10, suite="cpkv-cpu")

REPO = find_queue_root()
PIN = load_pin(REPO)


@pytest.fixture(autouse=True)
def _shared_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Temporary queue roots share the repo's wheel cache instead of downloading into their own."""
    monkeypatch.setenv("SGLANG_CPKV_CACHE", str(cache_dir(REPO)))


def _copy_repo_files(dest: Path, with_queue: bool) -> Path:
    """The pin, the files that copy its version, the closure files and (``with_queue``) the queue, under ``dest``."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / PIN_FILE, dest / PIN_FILE)
    for rel in SCANNED_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dest / rel)
    for rel in [*SCANNED_DIRS, "requirements", *(["patches"] if with_queue else [])]:
        shutil.copytree(REPO / rel, dest / rel)
    return dest


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_copy_of_the_version_names_the_pin() -> None:
    copies = version_copies(REPO)
    stale = [f"{path}:{line}: {version}" for path, line, version in copies if version != PIN.version]
    assert not stale, f"these disagree with {PIN_FILE} ({PIN.version}): {stale}"
    # The copies the image, compose, the extra, the README and the operations guide carry are all there to be checked.
    where = {path for path, _, _ in copies}
    documented = {"README.md", "docs/operations.md"}
    assert {"docker/Dockerfile", "docker/compose.pd.yaml", "python/pyproject.toml", *documented} <= where
    base = tomllib.loads((REPO / PIN_FILE).read_text())["image"]["base"]
    assert f"ARG BASE_IMAGE={base}\n" in (REPO / "docker" / "Dockerfile").read_text()


def test_rewriting_the_copies_moves_every_one_and_back_byte_for_byte(tmp_path: Path) -> None:
    root = _copy_repo_files(tmp_path / "repo", with_queue=False)
    before = _snapshot(root)
    for old, new in ((PIN.version, "9.8.7"), ("9.8.7", PIN.version)):
        for path, (_, text) in rewrite_version_references(root, old, new).items():
            path.write_text(text)
        assert {version for _, _, version in version_copies(root)} == {new}
    assert _snapshot(root) == before


PIN_TEXT = """\
# the pin, with every TOML string form
[upstream]
package = "sglang"
version = '0.5.22'   # a literal string
[upstream.wheels.cp311]
filename = "sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl"
sha256 = '''0000000000000000000000000000000000000000000000000000000000000000'''

[kernels]
# kept as it is: the new wheel does not pin it
sgl-flash-mla = "1.0.0"
"sglang-kernel" = "0.4.9"  # a quoted key
torch = \"\"\"2.13.0\"\"\"

[image]
base = "lmsysorg/sglang:v0.5.22-cu130"
dev_base = 'lmsysorg/sglang:dev-cu13'
"""


def test_pin_rewrite_keeps_comments_layout_and_quoting() -> None:
    wheels = {"cp311": WheelPin("cp311", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl", "ab" * 32)}
    text = rewrite_pin_toml(PIN_TEXT, "0.5.22", "0.5.23", wheels, {"sglang-kernel": "0.4.10", "torch": "2.14.1"})
    data = tomllib.loads(text)
    assert data["upstream"]["version"] == "0.5.23"
    assert data["upstream"]["wheels"]["cp311"] == {"filename": wheels["cp311"].filename, "sha256": "ab" * 32}
    assert data["kernels"] == {"sgl-flash-mla": "1.0.0", "sglang-kernel": "0.4.10", "torch": "2.14.1"}
    assert data["image"] == {"base": "lmsysorg/sglang:v0.5.23-cu130", "dev_base": "lmsysorg/sglang:dev-cu13"}
    expected = (
        PIN_TEXT.replace("0.5.22", "0.5.23")
        .replace("0" * 64, "ab" * 32)
        .replace('"0.4.9"', '"0.4.10"')
        .replace("2.13.0", "2.14.1")
    )
    assert text == expected, "only the values move; comments, key quoting and string forms stay"


def _wheel_with_metadata(path: Path, requires: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        lines = ["Metadata-Version: 2.4", "Name: sglang", "Version: 9.9.9", *[f"Requires-Dist: {r}" for r in requires]]
        zf.writestr("sglang-9.9.9.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_requires_dist_is_read_with_packaging(tmp_path: Path) -> None:
    wheel = _wheel_with_metadata(
        tmp_path / "sglang-9.9.9-cp311-cp311-manylinux_2_34_x86_64.whl",
        [
            "torch==2.14.1",
            "flashinfer_python[cu13]==0.7.2",  # an extra of the dependency, and a non-normalized name
            "Sgl.Deep_GEMM (==0.2.3.post2)",  # the old parenthesized form
            'sgl-flash-mla==1.0.0; platform_machine == "x86_64" and sys_platform == "linux"',
            'sgl-flash-mla==0.9.0; platform_machine == "aarch64"',
            'pytest==8.0.0; extra == "test"',  # an extra of sglang itself: not a plain install
            "numpy>=1.26,<3",  # a range pins nothing
            "kernels==0.14.*",  # nor does a wildcard
        ],
    )
    assert wheel_requirements(wheel, "cp311", "manylinux_2_34_x86_64") == {
        "torch": "2.14.1",
        "flashinfer-python": "0.7.2",
        "sgl-deep-gemm": "0.2.3.post2",
        "sgl-flash-mla": "1.0.0",
    }
    assert wheel_requirements(wheel, "cp311", "manylinux_2_34_aarch64")["sgl-flash-mla"] == "0.9.0"


def test_the_pinned_kernels_are_what_the_pinned_wheel_requires() -> None:
    """Every [kernels] entry the pinned wheel pins has its version (one it does not pin, a rebase flags)."""
    wheel = fetch_pinned(PIN, "cp311", cache_dir(REPO))
    requires = wheel_requirements(wheel, "cp311", PIN.wheels["cp311"].platform)
    kernels = tomllib.loads((REPO / PIN_FILE).read_text())["kernels"]
    assert {"torch", "sglang-kernel"} <= set(requires) & set(kernels)
    assert {name: v for name, v in kernels.items() if name in requires} == {
        name: requires[name] for name in kernels if name in requires
    }


def test_a_rebase_onto_the_pinned_version_changes_no_byte(tmp_path: Path) -> None:
    root = _copy_repo_files(tmp_path / "repo", with_queue=True)
    before = _snapshot(root)
    ok, report = rebase(root, PIN.version)
    assert ok, report
    assert "result: SUCCESS" in report and "CONFLICT" not in report and "applies with offsets" not in report
    assert "requirements: 0 closure pins moved, 0 FLAGGED" in report, (
        "the CPU torch is only listed: it diverges on purpose"
    )
    assert _snapshot(root) == before, "a no-op rebase must leave UPSTREAM.toml, the queue and every copy as they are"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
