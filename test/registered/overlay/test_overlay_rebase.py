"""``overlay rebase`` on a real release pair: a queue made against sglang 0.5.22, rebased onto 0.5.23.

The queue is built by :mod:`sglang_cpkv.testing.overlay_demo` from the two released wheels (one
patch per verdict: clean, offsets, contained upstream, and optionally a conflict with three failing
hunks in two files) in a temporary queue root. The repo's own pin and queue are never touched. The
sha256 of a wheel that is not pinned yet is read from PyPI's index (CI has network to PyPI).
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from sglang_cpkv.overlay.common import OverlayError, sha256_file
from sglang_cpkv.overlay.patches import parse_patch
from sglang_cpkv.overlay.pin import PIN_FILE, WheelPin, find_queue_root, load_pin
from sglang_cpkv.overlay.queue import dump_manifest, load_queue, validate_queue
from sglang_cpkv.overlay.rebase import rebase
from sglang_cpkv.overlay.tree import check_queue
from sglang_cpkv.overlay.wheels import INDEX_URL_ENV, cache_dir, fetch_release, published_sha256, read_wheel_files
from sglang_cpkv.testing import overlay_demo
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.version_copies import SCANNED_DIRS, SCANNED_FILES, version_copies

register_cpu_ci(est_time=30, suite="cpkv-cpu")

REPO = find_queue_root()
CACHE = cache_dir(REPO)
NEW_WHEEL_SHA = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"  # PyPI sglang 0.5.23 cp311
NEW_WHEEL_NAME = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
CLI = [sys.executable, "-m", "sglang_cpkv.overlay"]


@pytest.fixture(autouse=True)
def _shared_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Temporary queue roots share the repo's wheel cache instead of downloading into their own."""
    monkeypatch.setenv("SGLANG_CPKV_CACHE", str(CACHE))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _rebase_cli(root: Path, report: Path) -> subprocess.CompletedProcess:
    cmd = [*CLI, "--queue-root", str(root), "rebase", "--to", overlay_demo.NEW_VERSION, "--report", str(report)]
    return subprocess.run(cmd, capture_output=True, text=True)


def _verdicts(report: str) -> dict[str, str]:
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| ") and "`" in line]
    return {cells[2].strip().strip("`"): cells[3].strip() for cells in rows}


def _copy_version_copies(root: Path, version: str) -> None:
    """The repo's README, docs/operations.md, pyproject and docker/ under ``root``, with every copy of the pin naming ``version``."""
    pinned = load_pin(REPO).version
    paths = [REPO / rel for rel in SCANNED_FILES] + [
        p for d in SCANNED_DIRS for p in (REPO / d).rglob("*") if p.is_file()
    ]
    for path in paths:
        target = root / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text()
        text = re.sub(rf"(sglang==|sglang:v|sglang-cpkv:){re.escape(pinned)}\b", rf"\g<1>{version}", text)
        target.write_text(text)
    assert {v for _, _, v in version_copies(root)} == {version}


def test_rebase_0_5_22_to_0_5_23_reports_each_verdict_and_moves_the_pin(tmp_path: Path) -> None:
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE)
    assert check_queue(root).startswith("ok: 3 patches"), "the demo queue must apply to its 0.5.22 pin"
    # Valid TOML a regular expression would have missed: the version in single quotes, the sha256 literal.
    pin_path = root / PIN_FILE
    pin_path.write_text(
        pin_path.read_text()
        .replace('version = "0.5.22"', "version = '0.5.22'  # moved by rebase")
        .replace(f'sha256 = "{overlay_demo.OLD_WHEEL.sha256}"', f"sha256 = '''{overlay_demo.OLD_WHEEL.sha256}'''")
    )
    _copy_version_copies(root, overlay_demo.OLD_VERSION)
    offset_patch_before = (root / "patches" / "core" / "demo-offset.patch").read_text()

    proc = _rebase_cli(root, tmp_path / "report.md")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "report.md").read_text()
    assert report == proc.stdout
    assert _verdicts(report) == {
        "core/demo-clean.patch": "applies cleanly",
        "core/demo-offset.patch": "applies with offsets; refreshed",
        "upstream-fixes/demo-contained.patch": "already contained upstream (reverse-applies): retirement candidate; retired: moved to the manifest's history",
    }

    pin = load_pin(root)
    assert pin.version == "0.5.23"
    assert pin.wheels["cp311"] == WheelPin("cp311", NEW_WHEEL_NAME, NEW_WHEEL_SHA)
    pin_text = pin_path.read_text()
    assert "version = '0.5.23'  # moved by rebase" in pin_text and f"sha256 = '''{NEW_WHEEL_SHA}'''" in pin_text
    assert 'sglang-kernel = "0.4.10"' in pin_text and 'sgl-deep-gemm = "0.2.3.post2"' in pin_text
    copies = version_copies(root)
    assert {v for _, _, v in copies} == {"0.5.23"}, "every copy of the version moves with the pin"
    assert "docker/compose.pd.yaml" in {path for path, _, _ in copies}

    queue = load_queue(root)
    assert queue.series == ["core/demo-clean.patch", "core/demo-offset.patch"]
    assert not (root / "patches" / "upstream-fixes" / "demo-contained.patch").exists()
    assert [e["last_refreshed"] for e in queue.manifest["patches"]] == ["0.5.23", "0.5.23"]
    assert [(h["patch"], h["retired_in"]) for h in queue.manifest["history"]] == [
        ("upstream-fixes/demo-contained.patch", "0.5.23")
    ]
    refreshed = (root / "patches" / "core" / "demo-offset.patch").read_text()
    assert refreshed != offset_patch_before
    assert refreshed.splitlines()[0] == offset_patch_before.splitlines()[0], "the header comment survives a refresh"
    # The rebased queue is a valid queue on the new pin: strict, no offsets.
    assert check_queue(root).startswith("ok: 2 patches")


def _gnu_patch_rejects(wheel: Path, patch_file: Path, tmp: Path) -> set[tuple[str, int]]:
    """What GNU patch itself rejects of ``patch_file`` on the pristine files of ``wheel``."""
    patch = parse_patch(patch_file.read_text(), patch_file.name)
    for rel, data in read_wheel_files(wheel, patch.touches).items():
        (tmp / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "sglang" / rel).write_bytes(data)
    proc = subprocess.run(
        ["patch", "--dry-run", "--force", "-p1", "-F0", "-i", str(patch_file)], cwd=tmp, capture_output=True, text=True
    )
    rejects, current = set(), ""
    for line in proc.stdout.splitlines():
        if line.startswith(("checking file ", "patching file ")):
            current = line.split(" file ", 1)[1].removeprefix("sglang/")
        elif line.startswith("Hunk #") and "FAILED" in line:
            rejects.add((current, int(line.split("#")[1].split()[0])))
    return rejects


def test_rebase_with_a_conflict_lists_every_failing_hunk_and_changes_nothing(tmp_path: Path) -> None:
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE, conflict=True)
    before = _snapshot(root)
    proc = _rebase_cli(root, tmp_path / "report.md")
    assert proc.returncode == 1
    assert "nothing was changed" in proc.stderr
    assert _snapshot(root) == before, "a failed rebase must leave pin, series, manifest and patches byte-identical"
    report = (tmp_path / "report.md").read_text()
    verdicts = _verdicts(report)
    assert verdicts["core/demo-conflict.patch"] == "CONFLICT"
    assert verdicts["core/demo-offset.patch"] == "applies with offsets", "no refresh is claimed when the rebase fails"
    assert "result: FAILED: nothing was changed" in report

    # Every failing hunk of every file is listed and shown; hunk 1 of memory_pool.py applies at an offset.
    expected = overlay_demo.CONFLICT_FAILING_HUNKS
    listed = set(re.findall(r"^### (\S+) hunk (\d+)$", report, re.M))
    assert {(path, int(n)) for path, n in listed} == expected
    patch_file = root / "patches" / "core" / "demo-conflict.patch"
    patch = parse_patch(patch_file.read_text(), "demo-conflict")
    for fp in patch.files:
        for index, hunk in enumerate(fp.hunks):
            shown = f"```diff\n{hunk.render().rstrip(chr(10))}\n```" in report
            assert shown == ((fp.path, index + 1) in expected), (fp.path, index + 1)
    if shutil.which("patch"):
        new_wheel = fetch_release("sglang", overlay_demo.NEW_VERSION, "cp311", overlay_demo.OLD_WHEEL.platform, CACHE)
        assert _gnu_patch_rejects(new_wheel, patch_file, tmp_path) == expected
        assert "cross-check: `patch --dry-run -F0` agrees with every verdict" in report
    else:
        assert "cross-check: not run: GNU patch is not installed" in report


def test_a_conflicting_patch_redone_against_the_new_release_lets_the_rebase_through(tmp_path: Path) -> None:
    """The documented fix-up: ``show --upstream --patch``, redo each edit, ``diff --upstream --patch``, rebase again."""
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE, conflict=True)
    assert _rebase_cli(root, tmp_path / "failed.md").returncode == 1
    name = "core/demo-conflict.patch"
    header = (root / "patches" / name).read_text().split("---", 1)[0]
    redo = [*CLI, "--queue-root", str(root)]
    edits = []
    for rel in (overlay_demo.CONFLICT_FILE, overlay_demo.CONFLICT_FILE_2):
        show = subprocess.run(
            [*redo, "show", "--upstream", "0.5.23", "--patch", name, "--file", rel], capture_output=True, text=True
        )
        assert show.returncode == 0, show.stderr
        lines = show.stdout.splitlines(keepends=True)
        edited = tmp_path / Path(rel).name
        edited.write_text("".join(lines[:20] + ["# sglang-cpkv demo hook (redone)\n"] + lines[20:]))
        edits += ["--file", rel, "--edited", str(edited)]
    diff = subprocess.run(
        [*redo, "diff", "--upstream", "0.5.23", "--patch", name, *edits], capture_output=True, text=True
    )
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout == "" and "its header comment kept" in diff.stderr, "diff --patch rewrites the patch in place"
    rewritten = (root / "patches" / name).read_text()
    assert rewritten.startswith(header + "--- a/sglang/"), "the patch's header comment is kept"

    proc = _rebase_cli(root, tmp_path / "report.md")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _verdicts(proc.stdout)[name] == "applies cleanly"
    assert check_queue(root).startswith("ok: 3 patches")


def test_rebase_keeps_the_manifest_format_valid(tmp_path: Path) -> None:
    """The manifest a rebase writes passes the same validation as a hand-written one."""
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE)
    ok, _ = rebase(root, overlay_demo.NEW_VERSION)
    assert ok
    assert validate_queue(load_queue(root), load_pin(root)) == []
    manifest_text = (root / "patches" / "manifest.json").read_text()
    assert manifest_text == dump_manifest(json.loads(manifest_text))


def _tampered_copy(wheel: Path, dest: Path) -> Path:
    """``wheel`` with one module added, under the same file name in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    copy = Path(shutil.copy(wheel, dest / wheel.name))
    with zipfile.ZipFile(copy, "a") as zf:
        zf.writestr("sglang/srt/tampered.py", "import os\n")
    return copy


def _offline_pip(monkeypatch: pytest.MonkeyPatch, links: Path) -> None:
    """pip 'downloads' from a local folder; the index's sha256 still comes from PyPI."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))


def _genuine_new_wheel() -> Path:
    return fetch_release("sglang", overlay_demo.NEW_VERSION, "cp311", overlay_demo.OLD_WHEEL.platform, CACHE)


def test_rebase_refuses_a_tampered_cached_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE)
    genuine = _genuine_new_wheel()
    cache = tmp_path / "cache"
    tampered = _tampered_copy(genuine, cache)
    tampered_sha = sha256_file(tampered)
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(genuine, links / genuine.name)
    monkeypatch.setenv("SGLANG_CPKV_CACHE", str(cache))
    _offline_pip(monkeypatch, links)

    ok, report = rebase(root, overlay_demo.NEW_VERSION)
    assert ok, report
    assert (
        f"refusing cached {tampered}: sha256 {tampered_sha}, the index publishes {NEW_WHEEL_SHA}"
        in capfd.readouterr().err
    )
    assert load_pin(root).wheels["cp311"].sha256 == NEW_WHEEL_SHA != tampered_sha
    assert sha256_file(cache / genuine.name) == NEW_WHEEL_SHA, "the tampered copy is replaced by a verified one"


def test_a_download_whose_sha256_is_not_the_published_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE)
    before = _snapshot(root)
    links = tmp_path / "links"
    tampered_sha = sha256_file(_tampered_copy(_genuine_new_wheel(), links))
    cache = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_CPKV_CACHE", str(cache))
    _offline_pip(monkeypatch, links)
    with pytest.raises(OverlayError, match=f"has sha256 {tampered_sha}, the index publishes {NEW_WHEEL_SHA}"):
        rebase(root, overlay_demo.NEW_VERSION)
    assert not list(cache.glob("*.whl")), "a refused download is not kept"
    assert _snapshot(root) == before


def test_the_published_sha256_is_read_from_a_pep503_html_index_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain HTML simple index (``#sha256=`` fragments), served on loopback."""
    page = tmp_path / "simple" / "sglang" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(
        "<!DOCTYPE html><html><body>\n"
        f'<a href="../../files/{NEW_WHEEL_NAME}#sha256={NEW_WHEEL_SHA}">{NEW_WHEEL_NAME}</a><br/>\n'
        '<a href="../../files/sglang-0.5.23.tar.gz">sglang-0.5.23.tar.gz</a><br/>\n'
        "</body></html>\n"
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setenv(INDEX_URL_ENV, f"http://127.0.0.1:{server.server_address[1]}/simple")
        try:
            assert published_sha256("sglang", NEW_WHEEL_NAME) == NEW_WHEEL_SHA
            with pytest.raises(OverlayError, match=re.escape("publishes no sha256 for sglang-0.5.23.tar.gz")):
                published_sha256("sglang", "sglang-0.5.23.tar.gz")
            with pytest.raises(OverlayError, match=re.escape("lists no sglang-0.5.99")):
                published_sha256("sglang", "sglang-0.5.99-cp311-cp311-manylinux_2_34_x86_64.whl")
        finally:
            server.shutdown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
