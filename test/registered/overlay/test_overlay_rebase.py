"""``overlay rebase`` on a real release pair: a queue made against sglang 0.5.22, rebased onto 0.5.23.

The queue is built by :mod:`sglang_cpkv.testing.overlay_demo` from the two released wheels (one
patch per verdict: clean, offsets, contained upstream, and optionally a conflict) in a temporary
queue root. The repo's own pin and queue are never touched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cpkv.overlay.pin import WheelPin, find_queue_root, load_pin
from sglang_cpkv.overlay.queue import dump_manifest, load_queue, validate_queue
from sglang_cpkv.overlay.rebase import rebase
from sglang_cpkv.overlay.tree import check_queue
from sglang_cpkv.overlay.wheels import cache_dir
from sglang_cpkv.testing import overlay_demo
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="cpkv-cpu")

CACHE = cache_dir(find_queue_root())
NEW_WHEEL_SHA = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"  # PyPI sglang 0.5.23 cp311


@pytest.fixture(autouse=True)
def _shared_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Temporary queue roots share the repo's wheel cache instead of downloading into their own."""
    monkeypatch.setenv("SGLANG_CPKV_CACHE", str(CACHE))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _rebase_cli(root: Path, report: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_cpkv.overlay",
            "--queue-root",
            str(root),
            "rebase",
            "--to",
            overlay_demo.NEW_VERSION,
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
    )


def _verdicts(report: str) -> dict[str, str]:
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| ") and "`" in line]
    return {cells[2].strip().strip("`"): cells[3].strip() for cells in rows}


def test_rebase_0_5_22_to_0_5_23_reports_each_verdict_and_moves_the_pin(tmp_path: Path) -> None:
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE)
    assert check_queue(root).startswith("ok: 3 patches"), "the demo queue must apply to its 0.5.22 pin"
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
    assert pin.wheels["cp311"] == WheelPin(
        "cp311", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl", NEW_WHEEL_SHA
    )
    kernels = (root / "UPSTREAM.toml").read_text()
    assert 'sglang-kernel = "0.4.10"' in kernels and 'sgl-deep-gemm = "0.2.3.post2"' in kernels

    queue = load_queue(root)
    assert queue.series == ["core/demo-clean.patch", "core/demo-offset.patch"]
    assert not (root / "patches" / "upstream-fixes" / "demo-contained.patch").exists()
    assert [e["last_refreshed"] for e in queue.manifest["patches"]] == ["0.5.23", "0.5.23"]
    assert [(h["patch"], h["retired_in"]) for h in queue.manifest["history"]] == [
        ("upstream-fixes/demo-contained.patch", "0.5.23")
    ]
    refreshed = (root / "patches" / "core" / "demo-offset.patch").read_text()
    assert refreshed != offset_patch_before
    assert refreshed.splitlines()[0] == offset_patch_before.splitlines()[0], (
        "the patch's header comment survives a refresh"
    )
    # The rebased queue is a valid queue on the new pin: strict, no offsets.
    assert check_queue(root).startswith("ok: 2 patches")


def test_rebase_with_a_conflict_exits_non_zero_and_changes_nothing(tmp_path: Path) -> None:
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
    conflict_patch = (root / "patches" / "core" / "demo-conflict.patch").read_text()
    hunk = conflict_patch[conflict_patch.index("@@") :].rstrip("\n")
    assert f"```diff\n{hunk}\n```" in report, "the report shows the failing hunk"


def test_a_conflicting_patch_redone_against_the_new_release_lets_the_rebase_through(tmp_path: Path) -> None:
    """The documented fix-up: ``show --upstream`` the new file, redo the edit, ``diff --upstream``, rebase again."""
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE, conflict=True)
    assert _rebase_cli(root, tmp_path / "failed.md").returncode == 1
    rel = overlay_demo.CONFLICT_FILE
    cli = [sys.executable, "-m", "sglang_cpkv.overlay", "--queue-root", str(root)]
    show = subprocess.run([*cli, "show", "--upstream", "0.5.23", "--file", rel], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    lines = show.stdout.splitlines(keepends=True)
    edited = tmp_path / "memory_pool.py"
    edited.write_text("".join(lines[:20] + ["# sglang-cpkv demo hook (redone)\n"] + lines[20:]))
    diff = subprocess.run(
        [*cli, "diff", "--upstream", "0.5.23", "--file", rel, "--edited", str(edited)], capture_output=True, text=True
    )
    assert diff.returncode == 0, diff.stderr
    conflict_patch = root / "patches" / "core" / "demo-conflict.patch"
    conflict_patch.write_text(conflict_patch.read_text().split("---", 1)[0] + diff.stdout)

    proc = _rebase_cli(root, tmp_path / "report.md")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _verdicts(proc.stdout)["core/demo-conflict.patch"] == "applies cleanly"
    assert check_queue(root).startswith("ok: 3 patches")


def test_rebase_keeps_the_manifest_format_valid(tmp_path: Path) -> None:
    """The manifest a rebase writes passes the same validation as a hand-written one."""
    root = overlay_demo.build_demo_queue(tmp_path / "queue", CACHE)
    ok, _ = rebase(root, overlay_demo.NEW_VERSION)
    assert ok
    assert validate_queue(load_queue(root), load_pin(root)) == []
    manifest_text = (root / "patches" / "manifest.json").read_text()
    assert manifest_text == dump_manifest(json.loads(manifest_text))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
