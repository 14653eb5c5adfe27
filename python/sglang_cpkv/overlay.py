"""The overlay tool: fetch the pinned upstream wheel, apply our patch queue in-tree, check it, rebase it.

The repo holds no upstream source. ``UPSTREAM.toml`` pins one upstream release (version, one wheel
file and sha256 per Python tag) and ``patches/`` holds the queue: ``series`` (the order),
``manifest.json`` (what each patch is for, the upstream files it touches, when it can be retired,
and the pristine sha256 of every touched file) and the unified diffs themselves.

    python -m sglang_cpkv.overlay fetch [--python-tag cp311] [--dest DIR]   # prints the wheel path
    python -m sglang_cpkv.overlay apply --sglang-root DIR                   # in-tree, idempotent
    python -m sglang_cpkv.overlay check [--wheel PATH]                      # whole queue vs the pin
    python -m sglang_cpkv.overlay show --file srt/x.py > /tmp/x.py          # the file as the queue leaves it
    python -m sglang_cpkv.overlay diff --file srt/x.py --edited /tmp/x.py   # write a new patch
    python -m sglang_cpkv.overlay pin-hashes                                # record pristine hashes
    python -m sglang_cpkv.overlay rebase --to 0.5.24 [--report PATH]        # move the pin
    python -m sglang_cpkv.overlay show|diff --upstream 0.5.24 ...           # redo a patch that conflicted

Patches apply strictly: every hunk's old lines must sit exactly at the stated line numbers (no
fuzz, no offsets), and a run writes files only once every hunk of every patch has applied. Only
``rebase`` looks for offsets, to refresh the patches onto a new release. The applier is pure
Python because the Docker image may lack ``patch``.

The queue root (the directory with ``UPSTREAM.toml`` and ``patches/``) is ``--queue-root``, else
``$SGLANG_CPKV_ROOT``, else the repo around this file (editable install), else the current
directory or one of its parents. Downloads are cached in ``$SGLANG_CPKV_CACHE``, else
``<queue root>/.cache/upstream``. Logs go to stderr; stdout carries only the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PACKAGE_DIR = "sglang"
RECORD_NAME = ".sglang_cpkv_overlay.json"
VERSION_FILES = ("_version.py", "version.py")
MANIFEST_FIELDS = ("patch", "description", "why", "touches", "origin", "forwarded", "retire_when", "last_refreshed")
HISTORY_FIELDS = ("patch", "description", "retired_in", "reason")
DIFF_CONTEXT = 3


class OverlayError(Exception):
    """A refusal whose message is meant for the user (the CLI prints it and exits 1)."""


def log(message: str) -> None:
    print(f"[overlay] {message}", file=sys.stderr, flush=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` in one rename, keeping its permission bits."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644  # mkstemp's own 0600 would hide new files
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------
# Queue root and pin


def _is_queue_root(path: Path) -> bool:
    return (path / "UPSTREAM.toml").is_file() and (path / "patches").is_dir()


def find_queue_root(explicit: str | None = None) -> Path:
    """Locate the directory holding ``UPSTREAM.toml`` and ``patches/`` (see the module docstring)."""
    for source, value in (("--queue-root", explicit), ("SGLANG_CPKV_ROOT", os.environ.get("SGLANG_CPKV_ROOT"))):
        if value:
            root = Path(value).resolve()
            if not _is_queue_root(root):
                raise OverlayError(f"{source}={value}: no UPSTREAM.toml and patches/ there")
            return root
    here = Path(__file__).resolve()
    for candidate in [here.parents[2], *[Path.cwd(), *Path.cwd().parents]]:
        if _is_queue_root(candidate):
            return candidate
    raise OverlayError(
        "cannot find the queue root (UPSTREAM.toml + patches/): pass --queue-root or set SGLANG_CPKV_ROOT"
    )


@dataclasses.dataclass(frozen=True)
class WheelPin:
    tag: str
    filename: str
    sha256: str

    @property
    def platform(self) -> str:
        """The platform tag of the wheel file name (``name-ver-py-abi-platform.whl``)."""
        return self.filename[: -len(".whl")].split("-")[4]


@dataclasses.dataclass(frozen=True)
class Pin:
    package: str
    version: str
    wheels: dict[str, WheelPin]


def load_pin(root: Path) -> Pin:
    path = root / "UPSTREAM.toml"
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    try:
        upstream = data["upstream"]
        wheels = {
            tag: WheelPin(tag, entry["filename"], entry["sha256"]) for tag, entry in upstream.get("wheels", {}).items()
        }
        return Pin(upstream["package"], upstream["version"], wheels)
    except (KeyError, TypeError) as exc:
        raise OverlayError(f"{path}: malformed [upstream] table ({exc!r})") from exc


def rewrite_pin_text(
    text: str, old_version: str, version: str, wheels: dict[str, WheelPin], kernels: dict[str, str]
) -> str:
    """Rewrite the pin's values in place, keeping its comments and layout.

    Sets ``[upstream] version``, each ``[upstream.wheels.TAG]`` filename/sha256, each ``[kernels]``
    entry named in ``kernels`` and the upstream version inside ``[image]`` tags.
    """
    table = ""
    out = []
    assign = re.compile(r'^(\s*)([A-Za-z0-9_.-]+|"[^"]+")(\s*=\s*)"([^"]*)"(.*)$')
    for line in text.splitlines(keepends=True):
        header = re.match(r"^\s*\[([^\]]+)\]", line)
        if header:
            table = header.group(1).strip()
        match = assign.match(line.rstrip("\n"))
        if match and not header:
            indent, key, eq, value, rest = match.groups()
            key_name = key.strip('"')
            new = value
            if table == "upstream" and key_name == "version":
                new = version
            elif table.startswith("upstream.wheels.") and key_name in ("filename", "sha256"):
                new = getattr(wheels[table.split(".", 2)[2]], key_name)
            elif table == "kernels" and key_name in kernels:
                new = kernels[key_name]
            elif table == "image":
                new = value.replace(f"v{old_version}-", f"v{version}-")
            line = f'{indent}{key}{eq}"{new}"{rest}\n'
        out.append(line)
    return "".join(out)


# --------------------------------------------------------------------------------------------
# Wheels


def cache_dir(root: Path) -> Path:
    return Path(os.environ.get("SGLANG_CPKV_CACHE") or root / ".cache" / "upstream")


def default_python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def pip_download(package: str, version: str, tag: str, platform: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel for ``tag``/``platform`` into ``dest``; return its path.

    pip checks the index's sha256 of the file it downloads; the caller checks it against the pin.
    The download lands in a temporary directory first so the cache never holds a partial file.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--implementation",
            "cp",
            "--python-version",
            f"{tag[2]}.{tag[3:]}",
            "--abi",
            tag,
            "--platform",
            platform,
            "--dest",
            tmp,
            f"{package}=={version}",
        ]
        log(f"downloading {package}=={version} ({tag}, {platform})")
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        got = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(got) != 1:
            raise OverlayError(
                f"pip download of {package}=={version} for {tag}/{platform} failed (exit {proc.returncode})"
            )
        target = dest / got[0].name
        os.replace(got[0], target)
    return target


def fetch_pinned(pin: Pin, tag: str, dest: Path) -> Path:
    """Return a verified copy of the pinned wheel for ``tag`` in ``dest``, downloading if needed."""
    if tag not in pin.wheels:
        raise OverlayError(f"UPSTREAM.toml pins no wheel for {tag} (pinned: {', '.join(sorted(pin.wheels))})")
    want = pin.wheels[tag]
    path = dest / want.filename
    if path.is_file():
        found = sha256_file(path)
        if found == want.sha256:
            log(f"using cached {path}")
            return path
        log(f"cached {path} has sha256 {found}, expected {want.sha256}: downloading again")
        path.unlink()
    path = pip_download(pin.package, pin.version, tag, want.platform, dest)
    if path.name != want.filename:
        raise OverlayError(f"pip downloaded {path.name}, expected {want.filename}")
    found = sha256_file(path)
    if found != want.sha256:
        path.unlink()
        raise OverlayError(f"{want.filename}: sha256 mismatch: expected {want.sha256} (UPSTREAM.toml), found {found}")
    return path


def fetch_unpinned(package: str, version: str, tag: str, platform: str, dest: Path) -> Path:
    """The wheel of a release not pinned yet (for ``rebase``); a cached file is reused as is."""
    cached = sorted(dest.glob(f"{package}-{version}-{tag}-{tag}-{platform}.whl"))
    return cached[0] if cached else pip_download(package, version, tag, platform, dest)


def read_wheel_files(wheel: Path, rel_paths: Iterable[str]) -> dict[str, bytes | None]:
    """Bytes of ``sglang/<rel>`` members of ``wheel`` (``None`` for a member it lacks)."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        return {rel: zf.read(f"{PACKAGE_DIR}/{rel}") if f"{PACKAGE_DIR}/{rel}" in names else None for rel in rel_paths}


def wheel_requirements(wheel: Path) -> dict[str, str]:
    """``name -> version`` for every exact ``Requires-Dist: name==version`` in the wheel's metadata."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    pins: dict[str, str] = {}
    for match in re.finditer(r"^Requires-Dist: ([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*\(?==([^\s;,)]+)", text, re.M):
        pins.setdefault(match.group(1).lower().replace("_", "-"), match.group(2))
    return pins


def unpack_subset(wheel: Path, rel_paths: Iterable[str], dest: Path) -> Path:
    """Write the version files and ``rel_paths`` of the wheel's ``sglang/`` under ``dest``; return the package dir."""
    root = dest / PACKAGE_DIR
    for rel, data in read_wheel_files(wheel, [*VERSION_FILES, *rel_paths]).items():
        if data is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
    return root


def tree_version(sglang_root: Path) -> str:
    """The upstream version of an installed or unpacked ``sglang`` dir, read without importing it."""
    pattern = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
    for name in VERSION_FILES:
        path = sglang_root / name
        if path.is_file():
            match = pattern.search(path.read_text(encoding="utf-8"))
            if match:
                return match.group(1)
    for meta in sorted(sglang_root.parent.glob(f"{PACKAGE_DIR}-*.dist-info/METADATA")):
        match = re.search(r"^Version: (\S+)", meta.read_text(encoding="utf-8"), re.M)
        if match:
            return match.group(1)
    raise OverlayError(
        f"{sglang_root}: cannot read the upstream version (no {' / '.join(VERSION_FILES)} with __version__, no dist-info)"
    )


# --------------------------------------------------------------------------------------------
# Unified diffs


def split_lines(text: str) -> list[str]:
    """Lines with their endings, split at ``\\n`` only (``str.splitlines`` also splits at form feeds etc.)."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


@dataclasses.dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]]  # (" " | "-" | "+", text with its line ending)

    @property
    def old_lines(self) -> list[str]:
        return [text for op, text in self.lines if op != "+"]

    @property
    def new_lines(self) -> list[str]:
        return [text for op, text in self.lines if op != "-"]

    def reversed(self) -> Hunk:
        flip = {"+": "-", "-": "+", " ": " "}
        return Hunk(self.new_start, self.new_len, self.old_start, self.old_len, [(flip[op], t) for op, t in self.lines])

    def render(self) -> str:
        out = [f"@@ -{self.old_start},{self.old_len} +{self.new_start},{self.new_len} @@\n"]
        for op, text in self.lines:
            out.append(op + text if text.endswith("\n") else f"{op}{text}\n\\ No newline at end of file\n")
        return "".join(out)


@dataclasses.dataclass
class FilePatch:
    path: str  # relative to the sglang package, e.g. srt/server_args.py
    hunks: list[Hunk]


@dataclasses.dataclass
class Patch:
    name: str
    header: str  # text before the first diff (a comment), kept by refreshes
    files: list[FilePatch]

    @property
    def touches(self) -> list[str]:
        return [fp.path for fp in self.files]


class HunkFailure(OverlayError):
    """A hunk whose old lines are not where (or anywhere) the patch says."""

    def __init__(self, patch: str, path: str, index: int, hunk: Hunk, reason: str):
        super().__init__(f"{patch}: {path} hunk {index + 1} ({hunk.render().splitlines()[0]}): {reason}")
        self.patch, self.path, self.index, self.hunk, self.reason = patch, path, index, hunk, reason


def _diff_path(raw: str, prefix: str, where: str) -> str:
    if "\t" in raw:
        raise OverlayError(f"{where}: timestamps are not allowed in patch headers ({raw.strip()!r})")
    raw = raw.strip()
    if raw == "/dev/null":
        raise OverlayError(f"{where}: patches may only modify existing upstream files (found /dev/null)")
    if not raw.startswith(f"{prefix}{PACKAGE_DIR}/"):
        raise OverlayError(f"{where}: path {raw!r} must start with {prefix}{PACKAGE_DIR}/")
    return raw[len(prefix) + len(PACKAGE_DIR) + 1 :]


def parse_patch(text: str, name: str) -> Patch:
    """Parse a ``-p1`` unified diff with ``a/sglang/...`` and ``b/sglang/...`` paths."""
    lines = split_lines(text)
    header: list[str] = []
    files: list[FilePatch] = []
    i = 0
    while i < len(lines) and not lines[i].startswith(("--- ", "diff --git ")):
        header.append(lines[i])
        i += 1
    while i < len(lines):
        line = lines[i]
        if line.startswith(("diff --git ", "index ")):
            i += 1
            continue
        if not line.startswith("--- "):
            raise OverlayError(f"{name}:{i + 1}: expected '--- a/{PACKAGE_DIR}/...', found {line.rstrip()!r}")
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise OverlayError(f"{name}:{i + 2}: expected '+++ b/{PACKAGE_DIR}/...' after {line.rstrip()!r}")
        old = _diff_path(line[4:], "a/", f"{name}:{i + 1}")
        new = _diff_path(lines[i + 1][4:], "b/", f"{name}:{i + 2}")
        if old != new:
            raise OverlayError(f"{name}:{i + 1}: renames are not supported ({old} -> {new})")
        i += 2
        file_patch = FilePatch(old, [])
        while i < len(lines) and lines[i].startswith("@@"):
            m = re.match(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", lines[i])
            if not m:
                raise OverlayError(f"{name}:{i + 1}: malformed hunk header {lines[i].rstrip()!r}")
            hunk = Hunk(int(m[1]), 1 if m[2] is None else int(m[2]), int(m[3]), 1 if m[4] is None else int(m[4]), [])
            i += 1
            old_seen = new_seen = 0
            while old_seen < hunk.old_len or new_seen < hunk.new_len:
                if i >= len(lines):
                    raise OverlayError(f"{name}: {old} hunk at -{hunk.old_start} ends early (file truncated?)")
                body = lines[i]
                op, text = (" ", "\n") if body in ("\n", "\r\n") else (body[0], body[1:])
                if op not in " -+":
                    raise OverlayError(f"{name}:{i + 1}: unexpected line in hunk: {body.rstrip()!r}")
                hunk.lines.append((op, text))
                old_seen += op != "+"
                new_seen += op != "-"
                i += 1
                if i < len(lines) and lines[i].startswith("\\"):
                    hunk.lines[-1] = (op, text.rstrip("\r\n"))
                    i += 1
            if old_seen != hunk.old_len or new_seen != hunk.new_len:
                raise OverlayError(f"{name}: {old} hunk at -{hunk.old_start}: line counts do not match its header")
            file_patch.hunks.append(hunk)
        if not file_patch.hunks:
            raise OverlayError(f"{name}: {old} has no hunks")
        files.append(file_patch)
    if not files:
        raise OverlayError(f"{name}: no diff found")
    return Patch(name, "".join(header), files)


def _find_block(
    lines: Sequence[str], block: Sequence[str], expected: int, lower: int, allow_offset: bool
) -> int | None:
    """Index where ``block`` occurs in ``lines``: at ``expected`` or, with offsets, the nearest one at/after ``lower``."""

    def matches(at: int) -> bool:
        return lower <= at <= len(lines) - len(block) and list(lines[at : at + len(block)]) == list(block)

    if matches(expected):
        return expected
    if not allow_offset:
        return None
    for distance in range(1, len(lines) + 1):
        for at in (expected - distance, expected + distance):
            if matches(at):
                return at
    return None


def apply_file_patch(
    lines: list[str], fp: FilePatch, patch_name: str, allow_offset: bool
) -> tuple[list[str], list[int]]:
    """Apply one file's hunks; return the new lines and each hunk's offset (0 when exact)."""
    out: list[str] = []
    cursor = 0  # next unconsumed index of ``lines``
    carried = 0  # offset found for the previous hunk, carried forward like GNU patch does
    offsets = []
    for index, hunk in enumerate(fp.hunks):
        stated = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        at = _find_block(lines, hunk.old_lines, stated + carried, cursor, allow_offset)
        if at is None:
            reason = (
                "context does not match at the stated line"
                if not allow_offset
                else "context not found anywhere in the file"
            )
            raise HunkFailure(patch_name, fp.path, index, hunk, reason)
        carried = at - stated
        offsets.append(carried)
        out.extend(lines[cursor:at])
        out.extend(hunk.new_lines)
        cursor = at + len(hunk.old_lines)
    out.extend(lines[cursor:])
    return out, offsets


def apply_patch(
    files: dict[str, list[str]], patch: Patch, allow_offset: bool = False, reverse: bool = False
) -> dict[str, list[int]]:
    """Apply ``patch`` to ``files`` (``path -> lines``) in place, all or nothing; return offsets per file."""
    staged: dict[str, list[str]] = {}
    offsets: dict[str, list[int]] = {}
    for fp in patch.files:
        if fp.path not in files:
            raise OverlayError(f"{patch.name}: {fp.path} does not exist upstream")
        if reverse:
            fp = FilePatch(fp.path, [h.reversed() for h in fp.hunks])
        staged[fp.path], offsets[fp.path] = apply_file_patch(
            staged.get(fp.path, files[fp.path]), fp, patch.name, allow_offset
        )
    files.update(staged)
    return offsets


def make_diff(rel_path: str, before: str, after: str) -> str:
    """A ``-p1`` unified diff of one upstream file, quilt-refresh style (no timestamps, 3 lines of context)."""
    out = []
    for line in difflib.unified_diff(
        split_lines(before),
        split_lines(after),
        f"a/{PACKAGE_DIR}/{rel_path}",
        f"b/{PACKAGE_DIR}/{rel_path}",
        n=DIFF_CONTEXT,
    ):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


# --------------------------------------------------------------------------------------------
# The queue


def read_series(path: Path) -> list[str]:
    """Patch paths in order; ``#`` starts a comment (also after an entry)."""
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


@dataclasses.dataclass
class Queue:
    root: Path
    series: list[str]
    manifest: dict

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    def patch_text(self, name: str) -> str:
        return (self.patches_dir / name).read_bytes().decode()

    def parsed(self) -> list[Patch]:
        return [parse_patch(self.patch_text(name), name) for name in self.series]

    def touched(self) -> list[str]:
        return sorted({path for patch in self.parsed() for path in patch.touches})

    def sha256(self) -> str:
        """Identity of the queue: the series order and every patch's bytes."""
        digest = hashlib.sha256()
        for name in self.series:
            digest.update(name.encode() + b"\0" + (self.patches_dir / name).read_bytes() + b"\0")
        return digest.hexdigest()


def load_queue(root: Path) -> Queue:
    patches = root / "patches"
    series = read_series(patches / "series") if (patches / "series").is_file() else []
    manifest_path = patches / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise OverlayError(f"{manifest_path}: invalid JSON ({exc})") from exc
    return Queue(root, series, manifest)


def dump_manifest(manifest: dict) -> str:
    return json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"


def validate_queue(queue: Queue, pin: Pin) -> list[str]:
    """Static checks of series, manifest and patch files; returns one message per problem."""
    errors: list[str] = []
    pdir = queue.patches_dir
    for name in ("series", "manifest.json"):
        path = pdir / name
        if not path.is_file():
            errors.append(f"missing {path}")
        elif path.read_bytes() and not path.read_bytes().endswith(b"\n"):
            errors.append(f"file does not end with newline: {path}")
    for name in sorted({n for n in queue.series if queue.series.count(n) > 1}):
        errors.append(f"patch appears more than once in series: {name}")
    entries = queue.manifest.get("patches")
    if (
        not isinstance(entries, list)
        or not isinstance(queue.manifest.get("history"), list)
        or not isinstance(queue.manifest.get("pristine_sha256"), dict)
    ):
        return errors + [
            "manifest.json must be an object with lists 'patches' and 'history' and an object 'pristine_sha256'"
        ]
    by_name: dict[str, dict] = {}
    for entry in entries:
        entry_name = str(entry.get("patch")) if isinstance(entry, dict) else "<not an object>"
        if entry_name in by_name:
            errors.append(f"manifest has more than one entry for {entry_name}")
        by_name[entry_name] = entry if isinstance(entry, dict) else {}
    for name in queue.series:
        if name not in by_name:
            errors.append(f"series entry has no manifest entry: {name}")
    for name in by_name:
        if name not in queue.series:
            errors.append(f"manifest entry is not in series: {name}")
    listed = set(queue.series)
    for path in sorted(pdir.rglob("*.patch")):
        if path.relative_to(pdir).as_posix() not in listed:
            errors.append(f"unused patch: {path.relative_to(pdir).as_posix()}")
    touched: set[str] = set()
    for name, entry in by_name.items():
        for field in MANIFEST_FIELDS:
            value = entry.get(field)
            if field == "touches":
                if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
                    errors.append(f"{name}: 'touches' must be a non-empty list of upstream paths")
            elif not isinstance(value, str) or not value.strip():
                errors.append(f"{name}: missing or empty '{field}'")
        forwarded = entry.get("forwarded")
        if (
            isinstance(forwarded, str)
            and forwarded not in ("no", "not-needed", "to forward")
            and not forwarded.startswith(("https://", "http://"))
        ):
            errors.append(f"{name}: 'forwarded' must be no | not-needed | to forward | a URL, found {forwarded!r}")
        if entry.get("last_refreshed") not in (None, pin.version):
            errors.append(
                f"{name}: last_refreshed {entry.get('last_refreshed')!r} is not the pinned {pin.version} (run `overlay rebase`)"
            )
        path = pdir / name
        if name not in queue.series:
            continue
        if not path.is_file():
            errors.append(f"series entry does not exist: {name}")
            continue
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            errors.append(f"patch file does not end with newline: {name}")
        try:
            patch = parse_patch(data.decode(), name)
        except (OverlayError, UnicodeDecodeError) as exc:
            errors.append(str(exc))
            continue
        touched.update(patch.touches)
        if isinstance(entry.get("touches"), list) and sorted(set(patch.touches)) != sorted(set(entry["touches"])):
            errors.append(
                f"{name}: manifest touches {sorted(set(entry['touches']))} but the patch touches {sorted(set(patch.touches))}"
            )
    for index, entry in enumerate(queue.manifest["history"]):
        missing = [
            f
            for f in HISTORY_FIELDS
            if not (isinstance(entry, dict) and isinstance(entry.get(f), str) and entry[f].strip())
        ]
        if missing:
            errors.append(f"history[{index}]: missing {', '.join(missing)}")
    pristine = queue.manifest["pristine_sha256"]
    for rel in sorted(touched - set(pristine)):
        errors.append(f"pristine_sha256 lacks touched file {rel} (run `overlay pin-hashes`)")
    for rel in sorted(set(pristine) - touched):
        errors.append(f"pristine_sha256 lists {rel}, which no patch touches (run `overlay pin-hashes`)")
    return errors


def require_valid(queue: Queue, pin: Pin) -> None:
    errors = validate_queue(queue, pin)
    if errors:
        raise OverlayError("the patch queue is invalid:\n  " + "\n  ".join(errors))


# --------------------------------------------------------------------------------------------
# apply


def apply_queue(sglang_root: Path, queue_root: Path) -> str:
    """Apply the queue in-tree to ``sglang_root``; return what happened (a no-op when already applied)."""
    pin = load_pin(queue_root)
    if not sglang_root.is_dir():
        raise OverlayError(f"--sglang-root {sglang_root} is not a directory")
    found = tree_version(sglang_root)
    if found != pin.version:
        raise OverlayError(
            f"upstream version mismatch in {sglang_root}: expected {pin.package} {pin.version} (UPSTREAM.toml), found {found}"
        )
    queue = load_queue(queue_root)
    require_valid(queue, pin)
    patches = queue.parsed()
    pristine: dict[str, str] = queue.manifest["pristine_sha256"]
    current: dict[str, bytes] = {}
    for rel in sorted(pristine):
        if not (sglang_root / rel).is_file():
            raise OverlayError(f"{sglang_root / rel} is missing: the queue touches it")
        current[rel] = (sglang_root / rel).read_bytes()
    queue_sha = queue.sha256()
    record_path = sglang_root / RECORD_NAME
    record = json.loads(record_path.read_text(encoding="utf-8")) if record_path.is_file() else None
    if (
        record
        and record.get("queue_sha256") == queue_sha
        and all(
            sha256_bytes(data) == record.get("files", {}).get(rel, {}).get("patched_sha256")
            for rel, data in current.items()
        )
    ):
        return f"already applied: {len(patches)} patches (queue {queue_sha[:12]}) in {sglang_root}; nothing to do"
    mismatched = [
        (rel, want, sha256_bytes(current[rel])) for rel, want in pristine.items() if sha256_bytes(current[rel]) != want
    ]
    if mismatched:
        recorded = record.get("files", {}) if record else {}

        def state(rel: str, got: str) -> str:
            if recorded.get(rel, {}).get("patched_sha256") == got:
                return " (as the recorded overlay left it)"
            return " (changed after the recorded overlay)" if rel in recorded else ""

        detail = "\n  ".join(
            f"{rel}: expected pristine sha256 {want}, found {got}{state(rel, got)}" for rel, want, got in mismatched
        )
        hint = (
            f" (the tree records overlay queue {record.get('queue_sha256', '?')[:12]}; reinstall pristine {pin.package}=={pin.version})"
            if record
            else ""
        )
        raise OverlayError(
            f"touched files in {sglang_root} are not the pinned {pin.version} originals{hint}:\n  {detail}"
        )
    files = {rel: split_lines(data.decode()) for rel, data in current.items()}
    for patch in patches:
        apply_patch(files, patch)
    new_bytes = {rel: "".join(lines).encode() for rel, lines in files.items()}
    for rel, data in new_bytes.items():
        if data != current[rel]:
            write_atomic(sglang_root / rel, data)
    record = {
        "tool": "sglang_cpkv.overlay",
        "upstream": f"{pin.package}=={pin.version}",
        "queue_sha256": queue_sha,
        "patches": [{"patch": name, "sha256": sha256_file(queue.patches_dir / name)} for name in queue.series],
        "files": {
            rel: {"pristine_sha256": pristine[rel], "patched_sha256": sha256_bytes(new_bytes[rel])}
            for rel in sorted(new_bytes)
        },
    }
    write_atomic(record_path, (json.dumps(record, indent=2) + "\n").encode())
    return f"applied {len(patches)} patches ({len(new_bytes)} files, queue {queue_sha[:12]}) to {sglang_root}; recorded in {RECORD_NAME}"


# --------------------------------------------------------------------------------------------
# check, diff, pin-hashes


def pinned_wheel(root: Path, pin: Pin, tag: str | None = None) -> Path:
    """The verified pinned wheel (this interpreter's tag if pinned, else the first pinned tag)."""
    if tag is None:
        tag = default_python_tag() if default_python_tag() in pin.wheels else next(iter(pin.wheels))
    return fetch_pinned(pin, tag, cache_dir(root))


def check_queue(root: Path, wheel: Path | None = None) -> str:
    """Validate the queue and prove it applies (strictly, then idempotently) to the pinned wheel."""
    pin = load_pin(root)
    queue = load_queue(root)
    require_valid(queue, pin)
    if wheel is None:
        wheel = pinned_wheel(root, pin)
    else:
        found = sha256_file(wheel)
        if found not in {w.sha256 for w in pin.wheels.values()}:
            raise OverlayError(
                f"{wheel} is not a pinned wheel: sha256 {found} matches no [upstream.wheels.*] of {pin.package} {pin.version}"
            )
    touched = queue.touched()
    wheel_files = read_wheel_files(wheel, touched)
    stale = [
        f"{rel}: manifest pristine_sha256 {queue.manifest['pristine_sha256'][rel]}, wheel has {sha256_bytes(data) if data else 'no such file'}"
        for rel, data in wheel_files.items()
        if data is None or sha256_bytes(data) != queue.manifest["pristine_sha256"][rel]
    ]
    if stale:
        raise OverlayError(
            f"pristine hashes do not match {wheel.name} (run `overlay pin-hashes`):\n  " + "\n  ".join(stale)
        )
    with tempfile.TemporaryDirectory(prefix="cpkv-overlay-check-") as tmp:
        tree = unpack_subset(wheel, touched, Path(tmp))
        log(apply_queue(tree, root))
        again = apply_queue(tree, root)
        if not again.startswith("already applied"):
            raise OverlayError(f"a second apply was not a no-op: {again}")
    return f"ok: {len(queue.series)} patches, {len(touched)} upstream files, apply cleanly to {wheel.name}"


def queue_state(
    root: Path, pin: Pin, rel_paths: Iterable[str], through_queue: bool, upstream: str | None = None
) -> dict[str, str]:
    """Texts of ``rel_paths`` in the pinned wheel, with the current series applied when ``through_queue``.

    With ``upstream`` (a release other than the pin, e.g. the target of a rebase that conflicted),
    the files come pristine from that release's wheel instead.
    """
    queue = load_queue(root)
    rel_paths = sorted(set(rel_paths))
    if upstream is not None and upstream != pin.version:
        tag = default_python_tag() if default_python_tag() in pin.wheels else next(iter(pin.wheels))
        wheel = fetch_unpinned(pin.package, upstream, tag, pin.wheels[tag].platform, cache_dir(root))
        source, patches = f"{pin.package} {upstream}", []
    else:
        wheel, source = pinned_wheel(root, pin), f"the pinned {pin.package} {pin.version}"
        patches = queue.parsed() if through_queue else []
    wanted = sorted(set(rel_paths) | {p for patch in patches for p in patch.touches})
    data = read_wheel_files(wheel, wanted)
    missing = [rel for rel in rel_paths if data[rel] is None]
    if missing:
        raise OverlayError(f"not in {source} wheel: {', '.join(missing)}")
    files = {rel: split_lines(blob.decode()) for rel, blob in data.items() if blob is not None}
    for patch in patches:
        apply_patch(files, patch)
    return {rel: "".join(files[rel]) for rel in rel_paths}


def diff_files(root: Path, pairs: list[tuple[str, Path]], pristine: bool, upstream: str | None = None) -> str:
    """A patch from edited copies of upstream files, against the base that ``queue_state`` gives."""
    pin = load_pin(root)
    base = queue_state(root, pin, [rel for rel, _ in pairs], through_queue=not pristine, upstream=upstream)
    out = "".join(make_diff(rel, base[rel], edited.read_bytes().decode()) for rel, edited in sorted(pairs))
    if not out:
        raise OverlayError("the edited files do not differ from the base: no patch to write")
    return out


def pin_hashes(root: Path, wheel: Path | None = None) -> str:
    """Record the pinned wheel's sha256 of every touched file as ``pristine_sha256`` in the manifest."""
    pin = load_pin(root)
    queue = load_queue(root)
    touched = queue.touched()
    data = read_wheel_files(wheel or pinned_wheel(root, pin), touched)
    missing = [rel for rel, blob in data.items() if blob is None]
    if missing:
        raise OverlayError(f"not in the pinned {pin.package} {pin.version} wheel: {', '.join(missing)}")
    hashes = {rel: sha256_bytes(blob) for rel, blob in data.items() if blob is not None}
    manifest = {**queue.manifest, "pristine_sha256": dict(sorted(hashes.items()))}
    write_atomic(queue.patches_dir / "manifest.json", dump_manifest(manifest).encode())
    return f"recorded pristine sha256 of {len(touched)} touched files ({pin.package} {pin.version})"


# --------------------------------------------------------------------------------------------
# rebase


@dataclasses.dataclass
class Verdict:
    patch: str
    kind: str  # clean | offsets | contained | conflict
    detail: str = ""
    failure: HunkFailure | None = None


VERDICT_TEXT = {
    "clean": "applies cleanly",
    "offsets": "applies with offsets",
    "contained": "already contained upstream (reverse-applies): retirement candidate",
    "conflict": "CONFLICT",
}
VERDICT_ACTION = {"offsets": "refreshed", "contained": "retired: moved to the manifest's history"}


def classify(files: dict[str, list[str]], patch: Patch) -> Verdict:
    """Try ``patch`` on ``files`` (updated in place unless it conflicts or is contained)."""
    trial = dict(files)
    try:
        apply_patch(trial, patch)
        files.update(trial)
        return Verdict(patch.name, "clean")
    except HunkFailure as exc:
        strict_failure = exc
    except OverlayError as exc:
        return Verdict(patch.name, "conflict", str(exc))
    trial = dict(files)
    try:
        offsets = apply_patch(trial, patch, allow_offset=True)
        files.update(trial)
        moved = "; ".join(
            f"{path} hunk {i + 1}: {o:+d} lines" for path, offs in offsets.items() for i, o in enumerate(offs) if o
        )
        return Verdict(patch.name, "offsets", moved)
    except HunkFailure:
        pass
    try:
        apply_patch(dict(files), patch, allow_offset=True, reverse=True)
        return Verdict(patch.name, "contained", "every hunk reverse-applies to the new release")
    except HunkFailure:
        reason = f"{strict_failure.path} hunk {strict_failure.index + 1}: its old lines are neither at the stated line nor at any offset, and the patch does not reverse-apply"
        return Verdict(patch.name, "conflict", reason, strict_failure)


def render_report(
    old: str,
    new: str,
    root: Path,
    wheels: dict[str, WheelPin],
    verdicts: list[Verdict],
    ok: bool,
    pin_diff: str,
    unpinned_kernels: list[str],
) -> str:
    lines = [
        f"# Rebase report: sglang {old} -> {new}",
        "",
        f"- queue: `{root}` ({len(verdicts)} patches in `patches/series`)",
        *[f"- wheel {tag}: `{w.filename}` sha256 `{w.sha256}`" for tag, w in sorted(wheels.items())],
        f"- result: {'SUCCESS: UPSTREAM.toml, manifest and refreshed patches updated' if ok else 'FAILED: nothing was changed'}",
        *(
            [
                f"- [kernels] not pinned by the {new} wheel's metadata, left as they were (check them): {', '.join(unpinned_kernels)}"
            ]
            if unpinned_kernels
            else []
        ),
        "",
        "| # | patch | verdict | details |",
        "|---|---|---|---|",
        *[
            f"| {i} | `{v.patch}` | {VERDICT_TEXT[v.kind]}{'; ' + VERDICT_ACTION[v.kind] if ok and v.kind in VERDICT_ACTION else ''} | {v.detail} |"
            for i, v in enumerate(verdicts, 1)
        ],
    ]
    for v in verdicts:
        if v.failure is not None:
            lines += [
                "",
                f"## Conflict: `{v.patch}`, {v.failure.path} hunk {v.failure.index + 1}",
                "",
                "```diff",
                v.failure.hunk.render().rstrip("\n"),
                "```",
            ]
    if ok:
        lines += ["", "## UPSTREAM.toml", "", "```diff", pin_diff.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def rebase(root: Path, version: str, report_path: Path | None = None) -> tuple[bool, str]:
    """Move the queue onto upstream ``version``; change files only when every patch survives."""
    pin = load_pin(root)
    queue = load_queue(root)
    require_valid(queue, pin)
    patches = queue.parsed()
    new_wheels: dict[str, WheelPin] = {}
    paths: dict[str, Path] = {}
    for tag, old_wheel in pin.wheels.items():
        path = fetch_unpinned(pin.package, version, tag, old_wheel.platform, cache_dir(root))
        new_wheels[tag] = WheelPin(tag, path.name, sha256_file(path))
        paths[tag] = path
    first = next(iter(paths.values()))
    touched = sorted({p for patch in patches for p in patch.touches})
    blobs = {tag: read_wheel_files(path, touched) for tag, path in paths.items()}
    differing = [rel for rel in touched if len({b[rel] for b in blobs.values()}) > 1]
    if differing:
        raise OverlayError(
            f"{pin.package} {version} wheels differ between Python tags in touched files: {', '.join(differing)}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        found = tree_version(unpack_subset(first, [], Path(tmp)))
    if found != version:
        raise OverlayError(f"{first.name} reports version {found}, expected {version}")
    base = blobs[next(iter(blobs))]
    files = {rel: split_lines(blob.decode()) for rel, blob in base.items() if blob is not None}
    verdicts: list[Verdict] = []
    refreshed: dict[str, str] = {}
    for patch in patches:
        before = {rel: list(files[rel]) for rel in patch.touches if rel in files}
        verdict = classify(files, patch)
        verdicts.append(verdict)
        if verdict.kind == "offsets":
            refreshed[patch.name] = patch.header + "".join(
                make_diff(rel, "".join(before[rel]), "".join(files[rel])) for rel in dict.fromkeys(patch.touches)
            )
    ok = all(v.kind != "conflict" for v in verdicts)
    pin_text = (root / "UPSTREAM.toml").read_text(encoding="utf-8")
    requirements = wheel_requirements(first)
    kernels_table = tomllib.loads(pin_text).get("kernels", {})
    kernels = {
        k: requirements[k.lower().replace("_", "-")]
        for k in kernels_table
        if k.lower().replace("_", "-") in requirements
    }
    unpinned_kernels = [k for k in kernels_table if k not in kernels]
    new_pin_text = rewrite_pin_text(pin_text, pin.version, version, new_wheels, kernels)
    pin_diff = "".join(
        difflib.unified_diff(pin_text.splitlines(True), new_pin_text.splitlines(True), "UPSTREAM.toml", "UPSTREAM.toml")
    )
    report = render_report(pin.version, version, root, new_wheels, verdicts, ok, pin_diff, unpinned_kernels)
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(report, encoding="utf-8")
    if not ok:
        return False, report
    retired = {v.patch for v in verdicts if v.kind == "contained"}
    kept = [name for name in queue.series if name not in retired]
    entries = {e["patch"]: e for e in queue.manifest["patches"]}
    manifest = dict(queue.manifest)
    manifest["patches"] = [{**entries[name], "last_refreshed": version} for name in kept]
    manifest["history"] = [
        *queue.manifest["history"],
        *[
            {
                "patch": name,
                "description": entries[name]["description"],
                "retired_in": version,
                "reason": f"contained upstream in {pin.package} {version} (reverse-applies); retire_when was: {entries[name]['retire_when']}",
            }
            for name in queue.series
            if name in retired
        ],
    ]
    still_touched = {p for patch in patches if patch.name not in retired for p in patch.touches}
    manifest["pristine_sha256"] = {
        rel: sha256_bytes(blob) for rel, blob in sorted(base.items()) if rel in still_touched and blob is not None
    }
    series_text = "".join(
        line
        for line in (queue.patches_dir / "series").read_text(encoding="utf-8").splitlines(keepends=True)
        if line.split("#", 1)[0].strip() not in retired
    )
    for name, text in refreshed.items():
        write_atomic(queue.patches_dir / name, text.encode())
    for name in retired:
        (queue.patches_dir / name).unlink()
    write_atomic(queue.patches_dir / "series", series_text.encode())
    write_atomic(queue.patches_dir / "manifest.json", dump_manifest(manifest).encode())
    write_atomic(root / "UPSTREAM.toml", new_pin_text.encode())
    return True, report


# --------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-cpkv-overlay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue-root", help="directory with UPSTREAM.toml and patches/ (default: see module docs)")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download and verify the pinned upstream wheel; print its path")
    fetch.add_argument(
        "--python-tag", default=None, help=f"e.g. cp311 (default: this interpreter's, {default_python_tag()})"
    )
    fetch.add_argument("--dest", type=Path, help="also copy the verified wheel here and print that path")
    apply = sub.add_parser("apply", help="apply the patch queue in-tree to an upstream sglang package dir")
    apply.add_argument("--sglang-root", type=Path, required=True, help="the 'sglang' package directory")
    check = sub.add_parser("check", help="validate the queue and prove it applies cleanly to the pinned wheel")
    check.add_argument("--wheel", type=Path, help="a local copy of the pinned wheel (default: fetch it)")
    diff = sub.add_parser("diff", help="print a patch from edited copies of upstream files")
    diff.add_argument(
        "--file",
        action="append",
        required=True,
        dest="files",
        help="upstream path relative to the sglang package, e.g. srt/server_args.py",
    )
    diff.add_argument(
        "--edited", action="append", required=True, type=Path, help="the edited copy (one per --file, same order)"
    )
    diff.add_argument(
        "--upstream",
        metavar="VERSION",
        help="diff against that release's pristine file (to redo a patch that conflicted in a rebase)",
    )
    diff.add_argument(
        "--pristine",
        action="store_true",
        help="diff against the pinned file itself, not the file as the current series leaves it",
    )
    show = sub.add_parser("show", help="print an upstream file as the current series leaves it (the base `diff` uses)")
    show.add_argument("--file", required=True, help="upstream path relative to the sglang package")
    show.add_argument("--pristine", action="store_true", help="print the pinned file itself")
    show.add_argument("--upstream", metavar="VERSION", help="print that release's pristine file instead")
    sub.add_parser("pin-hashes", help="record the pristine sha256 of every touched file in manifest.json")
    reb = sub.add_parser("rebase", help="move the pin and the queue onto another upstream release")
    reb.add_argument("--to", required=True, dest="version", help="the upstream version, e.g. 0.5.24")
    reb.add_argument("--report", type=Path, help="also write the markdown report here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        root = find_queue_root(args.queue_root)
        if args.command == "fetch":
            pin = load_pin(root)
            wheel = fetch_pinned(pin, args.python_tag or default_python_tag(), cache_dir(root))
            if args.dest is not None:
                args.dest.mkdir(parents=True, exist_ok=True)
                wheel = Path(shutil.copy2(wheel, args.dest / wheel.name))
            print(wheel)
        elif args.command == "apply":
            log(apply_queue(args.sglang_root.resolve(), root))
        elif args.command == "check":
            log(check_queue(root, args.wheel))
        elif args.command == "diff":
            if len(args.files) != len(args.edited):
                raise OverlayError("give one --edited per --file")
            sys.stdout.write(diff_files(root, list(zip(args.files, args.edited)), args.pristine, args.upstream))
        elif args.command == "show":
            sys.stdout.write(
                queue_state(root, load_pin(root), [args.file], not args.pristine, args.upstream)[args.file]
            )
        elif args.command == "pin-hashes":
            log(pin_hashes(root))
        elif args.command == "rebase":
            ok, report = rebase(root, args.version, args.report)
            sys.stdout.write(report)
            if not ok:
                log("rebase failed: nothing was changed (see the conflicts above)")
                return 1
    except OverlayError as exc:
        print(f"sglang-cpkv-overlay: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
