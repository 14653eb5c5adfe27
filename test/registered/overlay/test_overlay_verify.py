"""``overlay verify`` and a robust ``apply``: an installed tree checked against its record, an interrupted
apply named and finished, and user errors answered with a message instead of a traceback.

Trees are the real queue's touched files unpacked from the pinned wheel into temporary directories.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from sglang_cpkv.overlay.common import OverlayError, sha256_file
from sglang_cpkv.overlay.pin import find_queue_root, load_pin
from sglang_cpkv.overlay.queue import load_queue
from sglang_cpkv.overlay.tree import RECORD_NAME, apply_queue, verify_tree
from sglang_cpkv.overlay.wheels import cache_dir, fetch_pinned, unpack_subset
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="cpkv-cpu")

REPO = find_queue_root()
CLI = [sys.executable, "-m", "sglang_cpkv.overlay", "--queue-root", str(REPO)]


@pytest.fixture(scope="module")
def touched() -> list[str]:
    return sorted(load_queue(REPO).manifest["pristine_sha256"])


@pytest.fixture(scope="module")
def wheel() -> Path:
    return fetch_pinned(load_pin(REPO), "cp311", cache_dir(REPO))


@pytest.fixture()
def pristine(tmp_path: Path, wheel: Path, touched: list[str]) -> Path:
    return unpack_subset(wheel, touched, tmp_path / "site")


def _cli(*args: str, python: list[str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([*(python or CLI), *args], capture_output=True, text=True)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_verify_passes_on_an_applied_tree_and_names_each_defect(
    pristine: Path, wheel: Path, touched: list[str]
) -> None:
    tree = pristine
    never = _cli("verify", "--sglang-root", str(tree))
    assert never.returncode == 1 and f"has no {RECORD_NAME}: the patch queue was never applied" in never.stderr

    apply_queue(tree, REPO)
    ok = _cli("verify", "--sglang-root", str(tree))
    assert ok.returncode == 0, ok.stderr
    assert f"{len(load_queue(REPO).series)} patches" in ok.stderr and f"{len(touched)} files as recorded" in ok.stderr

    edited = tree / touched[0]
    edited.write_text(edited.read_text() + "# edited by hand\n")
    (tree / touched[1]).unlink()
    broken = _cli("verify", "--sglang-root", str(tree))
    assert broken.returncode == 1
    assert f"{touched[0]}: sha256 {sha256_file(edited)}, the overlay left" in broken.stderr
    assert f"{touched[1]}: missing" in broken.stderr
    unpack_subset(wheel, [touched[1]], tree.parent)  # the pristine file back, as a reinstall leaves it
    undone = _cli("verify", "--sglang-root", str(tree))
    assert undone.returncode == 1 and f"{touched[1]}: pristine again (the overlay was undone" in undone.stderr

    (tree / RECORD_NAME).write_text('{"state": "applied", "files": ')
    corrupt = _cli("verify", "--sglang-root", str(tree))
    assert corrupt.returncode == 1 and f"{RECORD_NAME} is not an overlay record (not JSON" in corrupt.stderr


def test_verify_refuses_a_tree_that_carries_another_queue(tmp_path: Path, pristine: Path) -> None:
    queue_root = tmp_path / "queue"
    shutil.copytree(REPO / "patches", queue_root / "patches")
    shutil.copy(REPO / "UPSTREAM.toml", queue_root / "UPSTREAM.toml")
    apply_queue(pristine, queue_root)
    series = queue_root / "patches" / "series"
    series.write_text(series.read_text() + "# a comment does not change the queue\n")
    assert verify_tree(pristine, queue_root).startswith("verified")
    first = load_queue(queue_root).series[0]
    patch = queue_root / "patches" / first
    patch.write_text("# reworded header\n" + patch.read_text())
    with pytest.raises(OverlayError, match=r"the tree carries queue .* has queue"):
        verify_tree(pristine, queue_root)


def test_an_interrupted_apply_is_named_and_finished_by_the_next_apply(
    tmp_path: Path, pristine: Path, wheel: Path, touched: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = unpack_subset(wheel, touched, tmp_path / "reference")
    apply_queue(reference, REPO)
    real_replace, calls = os.replace, []

    def crash_after_two_renames(src, dst):  # the record (applying), then one upstream file, then the crash
        calls.append(dst)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_after_two_renames)
    with pytest.raises(KeyboardInterrupt):
        apply_queue(pristine, REPO)
    monkeypatch.setattr(os, "replace", real_replace)
    assert json.loads((pristine / RECORD_NAME).read_text())["state"] == "applying"

    named = _cli("verify", "--sglang-root", str(pristine))
    assert named.returncode == 1
    assert "an interrupted apply" in named.stderr and f"1 of {len(touched)} files were patched" in named.stderr

    finished = _cli("apply", "--sglang-root", str(pristine))
    assert finished.returncode == 0, finished.stderr
    assert f"finishing an interrupted apply of this queue ({RECORD_NAME} says 'applying')" in finished.stderr
    assert _cli("verify", "--sglang-root", str(pristine)).returncode == 0
    for rel in touched:
        assert (pristine / rel).read_bytes() == (reference / rel).read_bytes(), rel


def test_apply_over_a_corrupt_record(pristine: Path, touched: list[str]) -> None:
    """On a pristine tree the record describes nothing and is replaced; on a patched tree it is named."""
    (pristine / RECORD_NAME).write_text("not json")
    applied = _cli("apply", "--sglang-root", str(pristine))
    assert applied.returncode == 0 and "applied" in applied.stderr, applied.stderr
    assert json.loads((pristine / RECORD_NAME).read_text())["state"] == "applied"
    (pristine / RECORD_NAME).write_text("[]")
    refused = _cli("apply", "--sglang-root", str(pristine))
    assert refused.returncode == 1
    assert "are not the pinned" in refused.stderr and f"{RECORD_NAME} is not an overlay record" in refused.stderr


def test_apply_and_verify_run_without_tomlkit(pristine: Path) -> None:
    """The image's install path (apply, verify) must not need the development-only tomlkit."""
    no_tomlkit = [
        sys.executable,
        "-c",
        "import sys; sys.modules['tomlkit'] = None; from sglang_cpkv.overlay.cli import main; sys.exit(main())",
        "--queue-root",
        str(REPO),
    ]
    for command in ("apply", "verify"):
        proc = _cli(command, "--sglang-root", str(pristine), python=no_tomlkit)
        assert proc.returncode == 0, proc.stderr
    rebase = _cli("rebase", "--to", load_pin(REPO).version, python=no_tomlkit)
    assert rebase.returncode == 1 and "`rebase` needs the tomlkit package" in rebase.stderr


def test_the_console_script_runs_the_same_cli(pristine: Path) -> None:
    """``sglang-cpkv-overlay`` (python/pyproject.toml) is the entry point ``python -m sglang_cpkv.overlay`` runs."""
    target = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())["project"]["scripts"][
        "sglang-cpkv-overlay"
    ]
    module, function = target.split(":")
    script = [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]
    apply_queue(pristine, REPO)
    via_script = _cli("--queue-root", str(REPO), "verify", "--sglang-root", str(pristine), python=script)
    via_module = _cli("verify", "--sglang-root", str(pristine))
    assert via_script.returncode == via_module.returncode == 0
    assert via_script.stderr == via_module.stderr


def test_user_errors_are_messages_not_tracebacks(tmp_path: Path) -> None:
    diff = _cli("diff", "--file", "srt/server_args.py", "--edited", str(tmp_path / "nowhere.py"))
    assert (
        diff.returncode == 1
        and f"--edited {tmp_path / 'nowhere.py'} (for --file srt/server_args.py): no such file" in diff.stderr
    )
    not_a_dir = _cli("verify", "--sglang-root", str(tmp_path / "nowhere"))
    assert not_a_dir.returncode == 1 and "is not a directory" in not_a_dir.stderr
    no_wheel = _cli("check", "--wheel", str(tmp_path / "nowhere.whl"))
    assert no_wheel.returncode == 1 and "no such file" in no_wheel.stderr
    unknown = _cli("show", "--patch", "core/nowhere.patch", "--file", "srt/server_args.py")
    assert unknown.returncode == 1 and "--patch core/nowhere.patch: not in patches/series" in unknown.stderr

    queue_root = tmp_path / "queue"
    shutil.copytree(REPO / "patches", queue_root / "patches")
    (queue_root / "UPSTREAM.toml").write_text("[upstream\nversion = 1\n")
    bad_pin = _cli("check", python=[sys.executable, "-m", "sglang_cpkv.overlay", "--queue-root", str(queue_root)])
    assert bad_pin.returncode == 1 and "UPSTREAM.toml: not valid TOML" in bad_pin.stderr
    shutil.copy(REPO / "UPSTREAM.toml", queue_root / "UPSTREAM.toml")
    (queue_root / "patches" / "manifest.json").write_text("[]\n")
    bad_manifest = _cli("check", python=[sys.executable, "-m", "sglang_cpkv.overlay", "--queue-root", str(queue_root)])
    assert bad_manifest.returncode == 1 and "manifest.json: the top level must be an object" in bad_manifest.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
