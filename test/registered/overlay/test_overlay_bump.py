"""The bump: ``overlay rebase`` moves the closure pins, prints the next commands, lets patches be redone in any order.

Two made-up upstream releases (9.0.0, the pin, and 9.1.0) are built here as wheels, with their
``Requires-Dist``, and served with every other package the rebase looks up by a PEP 691 index on
loopback (``$SGLANG_CPKV_INDEX_URL``, the tool's one seam to the index); the wheels sit in the
download cache, so nothing reaches the network. In 9.1.0 line ``a10`` of ``srt/a.py`` is rewritten
(a patch that touches it conflicts) and two lines open ``srt/b.py`` (a patch there applies with offsets).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from sglang_cpkv.overlay.closure import choose_version
from sglang_cpkv.overlay.patches import make_diff
from sglang_cpkv.overlay.pin import load_pin
from sglang_cpkv.overlay.queue import dump_manifest, load_queue, pin_hashes
from sglang_cpkv.overlay.rebase import rebase
from sglang_cpkv.overlay.tree import check_queue
from sglang_cpkv.overlay.wheels import INDEX_URL_ENV, SIMPLE_JSON, IndexFile
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="cpkv-cpu")

OLD, NEW = "9.0.0", "9.1.0"
TAGS = ("cp311", "cp312")
PLATFORM = "manylinux_2_34_x86_64"
CLI = [sys.executable, "-m", "sglang_cpkv.overlay"]
A_OLD = "".join(f"a{i} = {i}\n" for i in range(1, 31))
B_OLD = "".join(f"b{i} = {i}\n" for i in range(1, 31))
UPSTREAM_FILES = {
    OLD: {"srt/a.py": A_OLD, "srt/b.py": B_OLD},
    NEW: {"srt/a.py": A_OLD.replace("a10 = 10\n", "a10 = 'rewritten'\n"), "srt/b.py": "# one\n# two\n" + B_OLD},
}
# P1 inserts below a10 (conflicts in 9.1.0) and below b5 (moves); P2 below b20; P3 below a25 (moves).
P1 = ("core/p1.patch", [("srt/a.py", "a10 = 10\n", "# p1 a\n"), ("srt/b.py", "b5 = 5\n", "# p1 b\n")])
P2 = ("core/p2.patch", [("srt/b.py", "b20 = 20\n", "# p2 b\n")])
P3 = ("core/p3.patch", [("srt/a.py", "a25 = 25\n", "# p3 a\n")])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeIndex:
    """A PEP 691 simple index on loopback: ``files[project]`` lists its files; ``asked`` the projects read."""

    def __init__(self) -> None:
        self.files: dict[str, list[dict]] = {}
        self.asked: list[str] = []
        self.authorization: list[str | None] = []

    def add(self, project: str, filename: str, data: bytes = b"", requires_python: str | None = None, yanked=False):
        entry = {"filename": filename, "url": filename, "hashes": {"sha256": _sha(data or filename.encode())}}
        entry.update({"requires-python": requires_python, "yanked": yanked})
        self.files.setdefault(project, []).append(entry)
        return entry["hashes"]["sha256"]

    def handler(self, *args, **kwargs):
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                project = self.path.strip("/").split("/")[-1]
                index.asked.append(project)
                index.authorization.append(self.headers.get("Authorization"))
                if project not in index.files:
                    self.send_error(404)
                    return
                body = json.dumps({"meta": {"api-version": "1.0"}, "files": index.files[project]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", SIMPLE_JSON)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        return Handler(*args, **kwargs)


@pytest.fixture()
def index(monkeypatch: pytest.MonkeyPatch):
    fake = FakeIndex()
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), fake.handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setenv(INDEX_URL_ENV, f"http://127.0.0.1:{server.server_address[1]}/simple")
        monkeypatch.setenv("PIP_NO_INDEX", "1")  # every wheel is in the cache: pip must not be needed
        try:
            yield fake
        finally:
            server.shutdown()


def _upstream_wheel(cache: Path, version: str, tag: str, requires: list[str]) -> Path:
    path = cache / f"sglang-{version}-{tag}-{tag}-{PLATFORM}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("sglang/_version.py", f'__version__ = "{version}"\n')
        for rel, text in UPSTREAM_FILES[version].items():
            zf.writestr(f"sglang/{rel}", text)
        meta = ["Metadata-Version: 2.4", "Name: sglang", f"Version: {version}"]
        zf.writestr(f"sglang-{version}.dist-info/METADATA", "\n".join(meta + [f"Requires-Dist: {r}" for r in requires]))
    return path


def _insert_after(text: str, anchor: str, line: str) -> str:
    assert anchor in text
    return text.replace(anchor, anchor + line, 1)


def _queue_root(
    tmp_path: Path,
    index: FakeIndex,
    monkeypatch: pytest.MonkeyPatch,
    patches: list[tuple[str, list[tuple[str, str, str]]]],
    old_requires: list[str] = (),
    new_requires: list[str] = (),
    closure: dict[str, tuple[list[str], str]] | None = None,
) -> Path:
    """A queue root pinned to 9.0.0 with ``patches`` (each stacked on the ones before) and the closure files
    ``path -> (tags, text)``; both releases' wheels in the cache and on the index."""
    root, cache = tmp_path / "queue", tmp_path / "cache"
    (root / "patches").mkdir(parents=True)
    cache.mkdir()
    monkeypatch.setenv("SGLANG_CPKV_CACHE", str(cache))
    wheels = {}
    for version, requires in ((OLD, old_requires), (NEW, new_requires)):
        for tag in TAGS:
            wheels[version, tag] = _upstream_wheel(cache, version, tag, list(requires))
            index.add("sglang", wheels[version, tag].name, wheels[version, tag].read_bytes())
    pin = ["[upstream]", 'package = "sglang"', f'version = "{OLD}"']
    for tag in TAGS:
        w = wheels[OLD, tag]
        pin += ["", f"[upstream.wheels.{tag}]", f'filename = "{w.name}"', f'sha256 = "{_sha(w.read_bytes())}"']
    if closure:
        pin += ["", "[closure]", *[f'"{rel}" = {json.dumps(tags)}' for rel, (tags, _) in closure.items()]]
        for rel, (_, text) in closure.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    (root / "UPSTREAM.toml").write_text("\n".join(pin) + "\n")
    current = dict(UPSTREAM_FILES[OLD])
    entries = []
    for name, edits in patches:
        touched = list(dict.fromkeys(rel for rel, _, _ in edits))
        before = {rel: current[rel] for rel in touched}
        for rel, anchor, line in edits:
            current[rel] = _insert_after(current[rel], anchor, line)
        (root / "patches" / name).parent.mkdir(parents=True, exist_ok=True)
        diff = "".join(make_diff(rel, before[rel], current[rel]) for rel in touched)
        (root / "patches" / name).write_text(f"# test patch {name}\n{diff}")
        entries.append(
            {
                "patch": name,
                "description": f"test patch {name}",
                "why": "exercise the rebase",
                "touches": touched,
                "origin": "sglang-cpkv tests",
                "forwarded": "not-needed",
                "retire_when": "never (test fixture)",
                "last_refreshed": OLD,
            }
        )
    (root / "patches" / "series").write_text("".join(f"{name}\n" for name, _ in patches))
    (root / "patches" / "manifest.json").write_text(
        dump_manifest({"patches": entries, "pristine_sha256": {}, "history": []})
    )
    pin_hashes(root, wheels[OLD, "cp311"])
    assert check_queue(root, wheels[OLD, "cp311"]).startswith("ok:")
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "--queue-root", str(root), *args], capture_output=True, text=True)


def _foo_files(index: FakeIndex) -> dict[str, str]:
    """foo's releases: only 2.8.0 has wheels for both Pythons among those ``>=2,<3`` allows; sha256 per file."""
    names = [
        ("foo-3.0.0-py3-none-any.whl", None, False),  # outside the range
        ("foo-2.10.0rc1-py3-none-any.whl", None, False),  # a pre-release the range does not ask for
        ("foo-2.9.5-py3-none-any.whl", None, "broken"),  # yanked
        ("foo-2.9.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", None, False),  # no cp311 wheel
        ("foo-2.8.5-py3-none-any.whl", ">=3.13", False),  # not for these Pythons
        ("foo-2.8.0-cp311-cp311-manylinux_2_17_x86_64.whl", None, False),
        ("foo-2.8.0-cp312-cp312-manylinux_2_17_x86_64.whl", None, False),
        ("foo-2.8.0-cp312-cp312-manylinux_2_28_x86_64.whl", None, False),  # pip prefers it to 2_17
        ("foo-2.8.0-cp312-cp312-musllinux_1_2_x86_64.whl", None, False),  # another libc
        ("foo-2.8.0.tar.gz", None, False),
        ("foo-2.1.0-py3-none-any.whl", None, False),
    ]
    return {name: index.add("foo", name, requires_python=rp, yanked=yanked) for name, rp, yanked in names}


def test_an_index_credential_is_sent_as_basic_auth_and_never_shown(index: FakeIndex, monkeypatch) -> None:
    """A private index URL with ``user:password@`` (and a token in its query) works, and no output shows them: the
    credential goes as an Authorization header; an unreachable index's error shows ``<redacted>`` in their place."""
    import base64

    from sglang_cpkv.overlay.common import OverlayError
    from sglang_cpkv.overlay.wheels import index_files

    index.add("sglang", "sglang-9.0.0-cp311-cp311-manylinux_2_34_x86_64.whl")
    port = os.environ[INDEX_URL_ENV].split(":")[2].split("/")[0]
    monkeypatch.setenv(INDEX_URL_ENV, f"http://alice:s3cret-pass@127.0.0.1:{port}/simple")
    assert [f.filename for f in index_files("sglang")] == ["sglang-9.0.0-cp311-cp311-manylinux_2_34_x86_64.whl"]
    assert index.authorization[-1] == "Basic " + base64.b64encode(b"alice:s3cret-pass").decode()
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    monkeypatch.setenv(INDEX_URL_ENV, f"https://alice:s3cret-pass@127.0.0.1:{dead}/simple?token=tk-42")
    with pytest.raises(OverlayError) as refused:
        index_files("sglang")
    message = str(refused.value)
    assert f"cannot read https://<redacted>@127.0.0.1:{dead}/simple/sglang/?<redacted>" in message
    assert "s3cret" not in message and "tk-42" not in message and "alice" not in message


def test_the_newest_allowed_version_with_a_wheel_for_each_tag_is_chosen(index: FakeIndex) -> None:
    hashes = _foo_files(index)
    files = [
        IndexFile(e["filename"], e["hashes"]["sha256"], e["requires-python"], bool(e["yanked"]))
        for e in index.files["foo"]
    ]
    both = [(tag, PLATFORM) for tag in TAGS]
    version, chosen = choose_version(SpecifierSet(">=2,<3"), both, files)
    assert version == "2.8.0"
    assert {tag: f.filename for tag, f in chosen.items()} == {
        "cp311": "foo-2.8.0-cp311-cp311-manylinux_2_17_x86_64.whl",
        "cp312": "foo-2.8.0-cp312-cp312-manylinux_2_28_x86_64.whl",
    }
    assert chosen["cp312"].sha256 == hashes["foo-2.8.0-cp312-cp312-manylinux_2_28_x86_64.whl"]
    version, chosen = choose_version(SpecifierSet(">=2,<3"), [("cp312", PLATFORM)], files)
    assert version == "2.9.0", "a cp312-only file takes the newest that has a cp312 wheel"
    assert choose_version(SpecifierSet(">=2,<3"), [("cp311", "manylinux_2_12_x86_64")], files)[0] == "2.1.0"
    assert choose_version(SpecifierSet("==2.9.5"), both, files) is None, "a yanked release is never chosen"


def test_rebase_moves_each_closure_pin_the_new_release_no_longer_allows(
    tmp_path: Path, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    foo = _foo_files(index)
    openai = {v: index.add("openai", f"openai-{v}-py3-none-any.whl") for v in ("2.6.1", "2.8.0", "2.9.0")}
    dev = "# the dev environment\ntorch==2.13.0\nnumpy\nopenai==2.6.1\nfoo==1.5  # the range moved\nsetuptools>=77\n"
    gpu = f"# hashed, cp312 only\nopenai==2.6.1 --hash=sha256:{openai['2.6.1']}\nfoo==1.5 --hash=sha256:{'0' * 64}\n"
    root = _queue_root(
        tmp_path,
        index,
        monkeypatch,
        [P2],
        old_requires=["torch==2.14.1", "openai==2.6.1", "foo<2", "numpy"],
        new_requires=["torch==2.14.1", "openai==2.8.0", "foo>=2,<3", "numpy", 'bar==1; sys_platform == "win32"'],
        closure={"requirements/dev.txt": (list(TAGS), dev), "requirements/gpu.txt": (["cp312"], gpu)},
    )
    index.asked.clear()
    proc = _cli(root, "rebase", "--to", NEW)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    assert (root / "requirements" / "dev.txt").read_text() == dev.replace("openai==2.6.1", "openai==2.8.0").replace(
        "foo==1.5", "foo==2.8.0"
    ), "the moved pins change, nothing else: torch diverges on purpose, numpy and setuptools pin no version"
    assert (root / "requirements" / "gpu.txt").read_text() == (
        "# hashed, cp312 only\n"
        f"openai==2.8.0 --hash=sha256:{openai['2.8.0']}\n"
        f"foo==2.8.0 --hash=sha256:{foo['foo-2.8.0-cp312-cp312-manylinux_2_28_x86_64.whl']}\n"
    ), "one version for every file that pins a package; the hash is the wheel pip installs for the file's tag"
    assert load_pin(root).version == NEW
    assert sorted(set(index.asked) - {"sglang"}) == ["foo", "openai"], "only the packages that move are looked up"
    rows = {
        line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| `requirements/")
    }
    assert set(rows) == {
        f"`requirements/{f}`" for f in ("dev.txt:2", "dev.txt:4", "dev.txt:5", "gpu.txt:2", "gpu.txt:3")
    }
    assert "| torch | 2.13.0 | `==2.14.1` | kept: 9.0.0 required `==2.14.1`" in rows["`requirements/dev.txt:2`"]
    assert "| foo | 1.5 | `<3,>=2` | moved to 2.8.0" in rows["`requirements/dev.txt:5`"]
    assert "+openai==2.8.0" in proc.stdout.split("## Changes", 1)[1], "the report's changes show the requirement files"


def test_a_closure_pin_no_version_can_replace_is_flagged_and_nothing_changes(
    tmp_path: Path, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    index.add("baz", "baz-5.0.tar.gz")  # no wheel: nothing for the tags
    index.add("baz", "baz-5.0-cp39-cp39-manylinux_2_17_x86_64.whl")
    root = _queue_root(
        tmp_path,
        index,
        monkeypatch,
        [P2],
        old_requires=["baz==4.0"],
        new_requires=["baz==5.0"],
        closure={"requirements/dev.txt": (list(TAGS), "numpy\nbaz==4.0\n")},
    )
    before = _snapshot(root)
    report_path = tmp_path / "report.md"
    proc = _cli(root, "rebase", "--to", NEW, "--report", str(report_path))
    assert proc.returncode == 1 and "nothing was changed" in proc.stderr
    assert _snapshot(root) == before
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| `requirements/dev.txt:2`"))
    assert "| baz | 4.0 | `==5.0` | FLAGGED: no version on the index that `==5.0` allows" in row
    steps = proc.stdout.split("## Next steps", 1)[1]
    assert "# requirements/dev.txt:2: pin baz to a version that `==5.0` allows (now 4.0)" in steps
    assert f"rebase --to {NEW} --report {report_path}" in steps
    # The maintainer pins it by hand (the index may get the wheel later); the same command goes through.
    (root / "requirements" / "dev.txt").write_text("numpy\nbaz==5.0\n")
    assert rebase(root, NEW)[0]


def _sh_block(report: str) -> list[str]:
    steps = report.split("## Next steps", 1)[1]
    return steps.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()


def test_a_conflicting_rebase_prints_the_commands_that_redo_it(
    tmp_path: Path, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The printed commands, run as they stand (the editor step done by the test), let the rebase through."""
    root = _queue_root(tmp_path, index, monkeypatch, [P1, P2, P3])
    proc = _cli(root, "rebase", "--to", NEW)
    assert proc.returncode == 1
    commands = _sh_block(proc.stdout)
    redo = root / ".cache" / "rebase-redo" / NEW / "core" / "p1" / "srt" / "a.py"
    tool = f"python -m sglang_cpkv.overlay --queue-root {root}"
    assert commands == [
        "# core/p1.patch: srt/a.py",
        f"mkdir -p {redo.parent}",
        f"{tool} show --upstream {NEW} --patch core/p1.patch --file srt/a.py > {redo}",
        f"$EDITOR {redo}  # make the patch's change to srt/a.py again",
        f"{tool} diff --upstream {NEW} --patch core/p1.patch --file srt/a.py --edited {redo}",
        f"{tool} rebase --to {NEW}",
    ], "only the file that conflicts is redone; srt/b.py's section applies with offsets"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # `python`
    for command in commands:
        if command.startswith("#"):
            continue
        if command.startswith("$EDITOR"):
            redo.write_text(_insert_after(redo.read_text(), "a10 = 'rewritten'\n", "# p1 a (redone)\n"))
            continue
        ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
        assert ran.returncode == 0, (command, ran.stdout[-2000:], ran.stderr[-2000:])
    assert load_pin(root).version == NEW and load_queue(root).series == [P1[0], P2[0], P3[0]]
    assert "# p1 a (redone)" in (root / "patches" / P1[0]).read_text()
    assert check_queue(root).startswith("ok: 3 patches")


def test_show_of_a_later_patch_waits_only_for_earlier_conflicts_in_its_own_file(
    tmp_path: Path, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _queue_root(tmp_path, index, monkeypatch, [P1, P2, P3])
    # P1 conflicts in srt/a.py only: srt/b.py before P2 is 9.1.0's with P1's section of it applied.
    show = _cli(root, "show", "--upstream", NEW, "--patch", P2[0], "--file", "srt/b.py")
    assert show.returncode == 0, show.stderr
    assert show.stdout == _insert_after(UPSTREAM_FILES[NEW]["srt/b.py"], "b5 = 5\n", "# p1 b\n")
    # srt/a.py before P3 would need P1's conflicting section of it: refused, naming both.
    refused = _cli(root, "show", "--upstream", NEW, "--patch", P3[0], "--file", "srt/a.py")
    assert refused.returncode == 1
    assert re.search(
        r"core/p1\.patch comes before core/p3\.patch .* its section of srt/a\.py conflicts", refused.stderr
    )
    # diff --patch takes the same base: P2 redone on top of P1's section, while P1 still conflicts.
    edited = tmp_path / "b.py"
    edited.write_text(_insert_after(show.stdout, "b25 = 25\n", "# p2 b, moved\n"))
    diff = _cli(root, "diff", "--upstream", NEW, "--patch", P2[0], "--file", "srt/b.py", "--edited", str(edited))
    assert diff.returncode == 0, diff.stderr
    assert "+# p2 b, moved" in (root / "patches" / P2[0]).read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
