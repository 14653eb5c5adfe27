"""The overlay tool against the real pinned wheel: fetch, apply, idempotency, refusals, check, diff.

Queues that a test mutates live in temporary copies of the queue root; the repo's own
``UPSTREAM.toml`` and ``patches/`` are only read. Wheels come from the shared download cache
(``$SGLANG_CPKV_CACHE`` or ``<repo>/.cache/upstream``), fetched from PyPI on first use.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cpkv.overlay.common import OverlayError, sha256_bytes, sha256_file
from sglang_cpkv.overlay.patches import HunkFailure, apply_patch, make_diff, parse_patch, split_lines
from sglang_cpkv.overlay.pin import Pin, WheelPin, find_queue_root, load_pin
from sglang_cpkv.overlay.queue import dump_manifest, load_queue, pin_hashes, validate_queue
from sglang_cpkv.overlay.tree import RECORD_NAME, apply_queue, check_queue
from sglang_cpkv.overlay.wheels import cache_dir, fetch_pinned, fetch_release, read_wheel_files, unpack_subset
from sglang_cpkv.testing import overlay_demo
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=25, suite="cpkv-cpu")

REAL_ROOT = find_queue_root()
SERVER_ARGS = "srt/server_args.py"
COMPILE_UTILS = "srt/layers/deep_gemm_wrapper/compile_utils.py"


@pytest.fixture(autouse=True)
def _shared_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Temporary queue roots share the repo's wheel cache instead of downloading into their own."""
    monkeypatch.setenv("SGLANG_CPKV_CACHE", str(cache_dir(REAL_ROOT)))


@pytest.fixture(scope="module")
def cache() -> Path:
    return cache_dir(REAL_ROOT)


@pytest.fixture(scope="module")
def pin() -> Pin:
    return load_pin(REAL_ROOT)


@pytest.fixture(scope="module")
def wheel(pin: Pin, cache: Path) -> Path:
    return fetch_pinned(pin, "cp311", cache)


def _pristine(wheel: Path, rel: str) -> str:
    data = read_wheel_files(wheel, [rel])[rel]
    assert data is not None, f"{rel} missing from {wheel.name}"
    return data.decode()


def _insert_after(text: str, line_no: int, new_line: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[:line_no] + [new_line] + lines[line_no:])


def _empty_queue_root(dest: Path) -> Path:
    """A queue root with the real pin and an empty queue."""
    (dest / "patches").mkdir(parents=True)
    shutil.copy(REAL_ROOT / "UPSTREAM.toml", dest / "UPSTREAM.toml")
    (dest / "patches" / "series").write_text("# test queue\n")
    (dest / "patches" / "manifest.json").write_text(
        dump_manifest({"patches": [], "pristine_sha256": {}, "history": []})
    )
    return dest


def _add_patch(root: Path, name: str, text: str, touches: list[str], version: str) -> None:
    """Append a patch the way a contributor does: file, series line, manifest entry."""
    (root / "patches" / name).parent.mkdir(parents=True, exist_ok=True)
    (root / "patches" / name).write_text(text)
    with (root / "patches" / "series").open("a") as series:
        series.write(name + "\n")
    manifest = json.loads((root / "patches" / "manifest.json").read_text())
    manifest["patches"].append(
        {
            "patch": name,
            "description": f"test patch {name}",
            "why": "exercise the overlay tool",
            "touches": touches,
            "origin": "sglang-cpkv tests",
            "forwarded": "not-needed",
            "retire_when": "never (test fixture)",
            "last_refreshed": version,
        }
    )
    (root / "patches" / "manifest.json").write_text(dump_manifest(manifest))


def _overlay(*args: str) -> subprocess.CompletedProcess:
    """``python -m sglang_cpkv.overlay ARGS``, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "sglang_cpkv.overlay", *args], capture_output=True, text=True)


@pytest.fixture()
def test_queue(tmp_path: Path, wheel: Path, pin: Pin) -> Path:
    """Three patches on the pinned release: two stacked on server_args.py, one on compile_utils.py."""
    root = _empty_queue_root(tmp_path / "queue")
    server_args = _pristine(wheel, SERVER_ARGS)
    first = _insert_after(server_args, 40, "# cpkv test hook one\n")
    second = _insert_after(first, 80, "# cpkv test hook two\n")
    compile_utils = _pristine(wheel, COMPILE_UTILS)
    _add_patch(root, "core/add-hook-one.patch", make_diff(SERVER_ARGS, server_args, first), [SERVER_ARGS], pin.version)
    _add_patch(root, "core/add-hook-two.patch", make_diff(SERVER_ARGS, first, second), [SERVER_ARGS], pin.version)
    _add_patch(
        root,
        "upstream-fixes/fix-compile-utils.patch",
        make_diff(COMPILE_UTILS, compile_utils, _insert_after(compile_utils, 10, "# cpkv test fix\n")),
        [COMPILE_UTILS],
        pin.version,
    )
    pin_hashes(root, wheel)
    return root


def _tree(wheel: Path, dest: Path, rel_paths: list[str]) -> Path:
    return unpack_subset(wheel, rel_paths, dest)


def test_fetch_cli_prints_only_the_verified_wheel_path(wheel: Path) -> None:
    proc = _overlay("fetch", "--python-tag", "cp311")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(wheel)]
    assert "using cached" in proc.stderr


def _offline_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, wheel: Path) -> None:
    """Make pip 'download' from a local copy of the wheel, so the bad-sha path runs without network."""
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(wheel, links / wheel.name)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))


def test_fetch_rejects_a_wheel_whose_sha256_does_not_match_the_pin(
    tmp_path: Path, wheel: Path, pin: Pin, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_pip(monkeypatch, tmp_path, wheel)
    good = pin.wheels["cp311"]
    bad_sha = "0" * 64
    bad_pin = Pin(pin.package, pin.version, {"cp311": WheelPin("cp311", good.filename, bad_sha)})
    dest = tmp_path / "cache"
    with pytest.raises(OverlayError) as info:
        fetch_pinned(bad_pin, "cp311", dest)
    assert f"expected {bad_sha}" in str(info.value) and f"found {good.sha256}" in str(info.value)
    assert not (dest / good.filename).exists(), "a rejected wheel must not stay in the cache"


def test_fetch_replaces_a_corrupt_cached_wheel(
    tmp_path: Path, wheel: Path, pin: Pin, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_pip(monkeypatch, tmp_path, wheel)
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / wheel.name).write_bytes(b"truncated download")
    got = fetch_pinned(pin, "cp311", dest)
    assert sha256_file(got) == pin.wheels["cp311"].sha256


def test_apply_patches_in_order_records_and_is_idempotent(tmp_path: Path, test_queue: Path, wheel: Path) -> None:
    tree = _tree(wheel, tmp_path / "site", [SERVER_ARGS, COMPILE_UTILS, "README.md"])
    untouched = (tree / "README.md").read_bytes()
    message = apply_queue(tree, test_queue)
    assert message.startswith("applied 3 patches")
    server_args = (tree / SERVER_ARGS).read_text().splitlines()
    assert server_args[40] == "# cpkv test hook one" and server_args[80] == "# cpkv test hook two"
    assert (tree / COMPILE_UTILS).read_text().splitlines()[10] == "# cpkv test fix"
    assert (tree / "README.md").read_bytes() == untouched

    record = json.loads((tree / RECORD_NAME).read_text())
    queue = load_queue(test_queue)
    assert record["queue_sha256"] == queue.sha256()
    assert [p["patch"] for p in record["patches"]] == queue.series
    assert record["files"][SERVER_ARGS]["patched_sha256"] == sha256_file(tree / SERVER_ARGS)
    assert record["files"][SERVER_ARGS]["pristine_sha256"] == sha256_bytes(_pristine(wheel, SERVER_ARGS).encode())

    before = {rel: (tree / rel).read_bytes() for rel in (SERVER_ARGS, COMPILE_UTILS, RECORD_NAME)}
    proc = _overlay("--queue-root", str(test_queue), "apply", "--sglang-root", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert "already applied" in proc.stderr and "nothing to do" in proc.stderr
    assert {rel: (tree / rel).read_bytes() for rel in before} == before


def test_apply_refuses_another_upstream_version(tmp_path: Path, cache: Path, pin: Pin) -> None:
    """The real queue on a tree of another release: refused, naming the expected and the found version."""
    other = overlay_demo.OLD_VERSION if pin.version != overlay_demo.OLD_VERSION else overlay_demo.NEW_VERSION
    other_wheel = fetch_release("sglang", other, "cp311", pin.wheels["cp311"].platform, cache)
    tree = _tree(other_wheel, tmp_path / "site", [SERVER_ARGS])
    before = (tree / SERVER_ARGS).read_bytes()
    proc = _overlay("--queue-root", str(REAL_ROOT), "apply", "--sglang-root", str(tree))
    assert proc.returncode == 1
    assert f"expected sglang {pin.version}" in proc.stderr and f"found {other}" in proc.stderr, proc.stderr
    assert (tree / SERVER_ARGS).read_bytes() == before and not (tree / RECORD_NAME).exists()


def test_apply_refuses_a_tampered_touched_file(tmp_path: Path, test_queue: Path, wheel: Path) -> None:
    tree = _tree(wheel, tmp_path / "site", [SERVER_ARGS, COMPILE_UTILS])
    with (tree / COMPILE_UTILS).open("a") as handle:
        handle.write("# local edit\n")
    server_args = (tree / SERVER_ARGS).read_bytes()
    with pytest.raises(OverlayError) as info:
        apply_queue(tree, test_queue)
    message = str(info.value)
    expected = load_queue(test_queue).manifest["pristine_sha256"][COMPILE_UTILS]
    assert COMPILE_UTILS in message and f"expected pristine sha256 {expected}" in message
    assert f"found {sha256_file(tree / COMPILE_UTILS)}" in message
    assert SERVER_ARGS not in message
    assert (tree / SERVER_ARGS).read_bytes() == server_args, "nothing may be written when a file is refused"


def test_apply_writes_nothing_when_a_later_hunk_fails(tmp_path: Path, test_queue: Path, wheel: Path) -> None:
    fix = test_queue / "patches" / "upstream-fixes" / "fix-compile-utils.patch"
    lines = fix.read_text().splitlines(keepends=True)
    context = next(i for i, line in enumerate(lines) if line.startswith(" ") and line.strip())
    lines[context] = " # a context line that upstream does not have\n"
    fix.write_text("".join(lines))
    tree = _tree(wheel, tmp_path / "site", [SERVER_ARGS, COMPILE_UTILS])
    before = {rel: (tree / rel).read_bytes() for rel in (SERVER_ARGS, COMPILE_UTILS)}
    with pytest.raises(HunkFailure, match=r"fix-compile-utils\.patch.*hunk 1.*does not match"):
        apply_queue(tree, test_queue)
    assert {rel: (tree / rel).read_bytes() for rel in before} == before
    assert not (tree / RECORD_NAME).exists()


def test_apply_after_reinstall_reapplies_over_a_stale_record(tmp_path: Path, test_queue: Path, wheel: Path) -> None:
    """pip --force-reinstall restores pristine files but leaves our record: apply must patch again."""
    tree = _tree(wheel, tmp_path / "site", [SERVER_ARGS, COMPILE_UTILS])
    apply_queue(tree, test_queue)
    _tree(wheel, tmp_path / "site", [SERVER_ARGS, COMPILE_UTILS])
    assert apply_queue(tree, test_queue).startswith("applied 3 patches")
    assert "# cpkv test hook one\n" in (tree / SERVER_ARGS).read_text()


def test_check_passes_on_the_real_queue_against_the_pinned_wheel(wheel: Path) -> None:
    message = check_queue(REAL_ROOT, wheel)
    assert message.startswith(f"ok: {len(load_queue(REAL_ROOT).series)} patches")


def test_check_cli_on_a_test_queue(test_queue: Path) -> None:
    proc = _overlay("--queue-root", str(test_queue), "check")
    assert proc.returncode == 0, proc.stderr
    assert "ok: 3 patches, 2 upstream files" in proc.stderr


def _break_missing_entry(root: Path) -> str:
    manifest = json.loads((root / "patches" / "manifest.json").read_text())
    manifest["patches"] = [e for e in manifest["patches"] if e["patch"] != "core/add-hook-two.patch"]
    (root / "patches" / "manifest.json").write_text(dump_manifest(manifest))
    return "series entry has no manifest entry: core/add-hook-two.patch"


def _break_unused_patch(root: Path) -> str:
    (root / "patches" / "core" / "left-over.patch").write_text(
        (root / "patches" / "core" / "add-hook-one.patch").read_text()
    )
    return "unused patch: core/left-over.patch"


def _break_duplicate(root: Path) -> str:
    with (root / "patches" / "series").open("a") as series:
        series.write("core/add-hook-one.patch\n")
    return "patch appears more than once in series: core/add-hook-one.patch"


def _break_retire_when(root: Path) -> str:
    manifest = json.loads((root / "patches" / "manifest.json").read_text())
    del manifest["patches"][0]["retire_when"]
    (root / "patches" / "manifest.json").write_text(dump_manifest(manifest))
    return "core/add-hook-one.patch: missing or empty 'retire_when'"


def _break_our_name(root: Path) -> str:
    manifest = json.loads((root / "patches" / "manifest.json").read_text())
    manifest["patches"][0]["description"] += " Calls sglang_cpkv.hooks.dsa_extend.on_attn_cp_group_created."
    (root / "patches" / "manifest.json").write_text(dump_manifest(manifest))
    return (
        "core/add-hook-one.patch: 'description' names sglang_cpkv.hooks.dsa_extend.on_attn_cp_group_created, "
        "which python/sglang_cpkv does not define"
    )


def _break_touches(root: Path) -> str:
    manifest = json.loads((root / "patches" / "manifest.json").read_text())
    manifest["patches"][2]["touches"] = [SERVER_ARGS]
    (root / "patches" / "manifest.json").write_text(dump_manifest(manifest))
    return f"upstream-fixes/fix-compile-utils.patch: manifest touches ['{SERVER_ARGS}'] but the patch touches ['{COMPILE_UTILS}']"


def _break_newline(root: Path) -> str:
    path = root / "patches" / "core" / "add-hook-two.patch"
    path.write_text(path.read_text().rstrip("\n"))
    return "patch file does not end with newline: core/add-hook-two.patch"


def _break_manifest_extra(root: Path) -> str:
    manifest = json.loads((root / "patches" / "manifest.json").read_text())
    manifest["patches"].append({**manifest["patches"][0], "patch": "core/not-in-series.patch"})
    (root / "patches" / "manifest.json").write_text(dump_manifest(manifest))
    return "manifest entry is not in series: core/not-in-series.patch"


@pytest.mark.parametrize(
    "breaker",
    [
        _break_missing_entry,
        _break_unused_patch,
        _break_duplicate,
        _break_retire_when,
        _break_our_name,
        _break_touches,
        _break_newline,
        _break_manifest_extra,
    ],
)
def test_validation_names_each_queue_defect(test_queue: Path, breaker) -> None:
    pin = load_pin(test_queue)
    assert validate_queue(load_queue(test_queue), pin) == []
    expected = breaker(test_queue)
    errors = validate_queue(load_queue(test_queue), pin)
    assert expected in errors, errors
    with pytest.raises(OverlayError, match="the patch queue is invalid"):
        check_queue(test_queue)


def test_diff_cli_writes_a_patch_on_top_of_the_current_series(tmp_path: Path, test_queue: Path, wheel: Path) -> None:
    """A new patch on a file the series already touches is made against the file as the series leaves it."""
    tree = _tree(wheel, tmp_path / "site", [SERVER_ARGS, COMPILE_UTILS])
    apply_queue(tree, test_queue)
    show = _overlay("--queue-root", str(test_queue), "show", "--file", SERVER_ARGS)
    assert show.returncode == 0, show.stderr
    assert show.stdout == (tree / SERVER_ARGS).read_text(), "`show` prints the file as the series leaves it"
    edited = tmp_path / "server_args.py"
    edited.write_text(_insert_after(show.stdout, 120, "# cpkv test hook three\n"))
    proc = _overlay("--queue-root", str(test_queue), "diff", "--file", SERVER_ARGS, "--edited", str(edited))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"--- a/sglang/{SERVER_ARGS}\n+++ b/sglang/{SERVER_ARGS}\n@@ -118,")
    _add_patch(test_queue, "core/add-hook-three.patch", proc.stdout, [SERVER_ARGS], load_pin(test_queue).version)
    fresh = _tree(wheel, tmp_path / "fresh", [SERVER_ARGS, COMPILE_UTILS])
    assert apply_queue(fresh, test_queue).startswith("applied 4 patches")
    assert (fresh / SERVER_ARGS).read_text() == edited.read_text()


@pytest.mark.parametrize(
    "before, after",
    [
        ("a\nb\nc\n", "a\nb\nX\nc\n"),
        ("a\nb\nc", "a\nb\nc\nd"),  # no newline at end of file, on both sides
        ("a\nb\nc", "a\nb\nc\n"),  # the patch adds the final newline
        ("x\x0cy\nz\n", "x\x0cy\nZ\n"),  # a form feed is not a line break in a diff
    ],
)
def test_make_diff_parse_apply_round_trip(before: str, after: str) -> None:
    text = make_diff("srt/f.py", before, after)
    patch = parse_patch(text, "t.patch")
    files = {"srt/f.py": split_lines(before)}
    apply_patch(files, patch)
    assert "".join(files["srt/f.py"]) == after
    apply_patch(files, patch, reverse=True)
    assert "".join(files["srt/f.py"]) == before


def test_strict_apply_rejects_an_offset_that_rebase_would_accept() -> None:
    before = "".join(f"line {i}\n" for i in range(20))
    patch = parse_patch(make_diff("srt/f.py", before, before.replace("line 10\n", "line 10\nhook\n")), "t")
    moved = {"srt/f.py": split_lines("new upstream line\n" + before)}
    with pytest.raises(HunkFailure, match="does not match at the stated line"):
        apply_patch(dict(moved), patch)
    assert apply_patch(moved, patch, allow_offset=True) == {"srt/f.py": [1]}
    assert "line 10\nhook\nline 11\n" in "".join(moved["srt/f.py"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
