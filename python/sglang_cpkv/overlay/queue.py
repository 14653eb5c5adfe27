"""The queue: ``patches/series`` (the order), ``patches/manifest.json`` (why each patch exists, what it touches,
when to retire it, the pristine sha256 of every touched file) and the static checks CI runs on both."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
from pathlib import Path

from sglang_cpkv.overlay.common import OverlayError, sha256_bytes, write_if_changed
from sglang_cpkv.overlay.patches import Patch, parse_patch
from sglang_cpkv.overlay.pin import Pin, load_pin
from sglang_cpkv.overlay.wheels import pinned_wheel, read_wheel_files

MANIFEST_FIELDS = ("patch", "description", "why", "touches", "origin", "forwarded", "retire_when", "last_refreshed")
HISTORY_FIELDS = ("patch", "description", "retired_in", "reason")
PROSE_FIELDS = ("description", "why", "retire_when")  # where the manifest names our code
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # python/sglang_cpkv: the names are resolved in its sources
_OUR_NAME = re.compile(r"\bsglang_cpkv(?:\.\w+)+")


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
    if not isinstance(manifest, dict):
        raise OverlayError(f"{manifest_path}: the top level must be an object, found {type(manifest).__name__}")
    return Queue(root, series, manifest)


def dump_manifest(manifest: dict) -> str:
    return json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"


def _defined_names(body: list[ast.stmt]) -> dict[str, list[ast.stmt] | None]:
    """The names a module (or class) body binds at its top level; a class maps to its own body."""
    names: dict[str, list[ast.stmt] | None] = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node.body
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign):
            names.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, ast.ImportFrom):
            names.update({(a.asname or a.name): None for a in node.names})
    return names


def resolves(name: str, package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether ``sglang_cpkv.a.b.c`` names a module of ``package_dir``, or a name (or a class's member) defined in
    one: read from the sources, so the check needs no import (and no torch)."""
    parts = name.split(".")[1:]
    for cut in range(len(parts), -1, -1):
        base = package_dir.joinpath(*parts[:cut])
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not path.is_file():
            continue
        body: list[ast.stmt] | None = ast.parse(path.read_text(encoding="utf-8")).body
        for attr in parts[cut:]:
            names = _defined_names(body or [])
            if attr not in names:
                return False
            body = names[attr]
        return True
    return False


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
        for field in PROSE_FIELDS:
            text = entry.get(field)
            for our_name in sorted(set(_OUR_NAME.findall(text if isinstance(text, str) else ""))):
                if not resolves(our_name):
                    errors.append(f"{name}: '{field}' names {our_name}, which python/sglang_cpkv does not define")
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
    write_if_changed(queue.patches_dir / "manifest.json", dump_manifest(manifest).encode())
    return f"recorded pristine sha256 of {len(touched)} touched files ({pin.package} {pin.version})"
