"""The queue on an upstream tree: ``apply`` it in place, ``verify`` a tree against its record, ``check`` the queue.

``apply`` records what it does in ``sglang/.sglang_cpkv_overlay.json`` *before* it writes any upstream
file (state ``applying``: the queue, and the pristine and patched sha256 of every file), then writes the
files one atomic rename each, then marks the record ``applied``. A run that stops half-way therefore
leaves a tree whose every file is either pristine or patched, and a record that says so: ``verify`` names
it, and the next ``apply`` of the same queue finishes it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tempfile
from pathlib import Path

from sglang_cpkv.overlay.common import OverlayError, log, sha256_bytes, sha256_file, write_atomic, write_if_changed
from sglang_cpkv.overlay.patches import Patch, apply_patch, split_lines
from sglang_cpkv.overlay.pin import Pin, load_pin
from sglang_cpkv.overlay.queue import Queue, load_queue, require_valid
from sglang_cpkv.overlay.wheels import pinned_wheel, read_wheel_files, tree_version, unpack_subset

RECORD_NAME = ".sglang_cpkv_overlay.json"
RECORD_TOOL = "sglang_cpkv.overlay"
APPLYING, APPLIED = "applying", "applied"


class CorruptRecord(OverlayError):
    """The tree's record exists but cannot be read as one."""


@dataclasses.dataclass(frozen=True)
class Record:
    state: str  # APPLYING | APPLIED
    upstream: str  # e.g. sglang==0.5.23
    queue_sha256: str
    patches: list[str]
    files: dict[str, dict[str, str]]  # rel -> {"pristine_sha256": ..., "patched_sha256": ...}

    def patched_sha256(self, rel: str) -> str | None:
        return self.files.get(rel, {}).get("patched_sha256")


def installed_sglang_root() -> Path:
    """The ``sglang`` package directory this interpreter imports, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise OverlayError("this interpreter has no sglang package: pass --sglang-root DIR")
    return Path(spec.origin).parent


def read_record(sglang_root: Path) -> Record | None:
    """The tree's record, ``None`` when it has none; :class:`CorruptRecord` names a record that is not one."""
    path = sglang_root / RECORD_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptRecord(f"{path} is not an overlay record (not JSON: {exc})") from exc
    files = data.get("files") if isinstance(data, dict) else None
    valid = (
        isinstance(data, dict)
        and data.get("state") in (APPLYING, APPLIED)
        and all(isinstance(data.get(k), str) for k in ("upstream", "queue_sha256"))
        and isinstance(data.get("patches"), list)
        and all(isinstance(p, dict) and isinstance(p.get("patch"), str) for p in data["patches"])
        and isinstance(files, dict)
        and all(
            isinstance(h, dict) and all(isinstance(h.get(k), str) for k in ("pristine_sha256", "patched_sha256"))
            for h in files.values()
        )
    )
    if not valid:
        raise CorruptRecord(
            f"{path} is not an overlay record (it needs state, upstream, queue_sha256, patches and files "
            f"with a pristine and a patched sha256 each)"
        )
    return Record(data["state"], data["upstream"], data["queue_sha256"], [p["patch"] for p in data["patches"]], files)


def _write_record(sglang_root: Path, state: str, pin: Pin, queue: Queue, files: dict[str, dict[str, str]]) -> None:
    record = {
        "tool": RECORD_TOOL,
        "state": state,
        "upstream": f"{pin.package}=={pin.version}",
        "queue_sha256": queue.sha256(),
        "patches": [{"patch": name, "sha256": sha256_file(queue.patches_dir / name)} for name in queue.series],
        "files": files,
    }
    write_atomic(sglang_root / RECORD_NAME, (json.dumps(record, indent=2) + "\n").encode())


def _unpatched(rel: str, data: bytes, patches: list[Patch], pristine_sha256: str) -> list[str]:
    """The pristine lines of a file the queue was applied to: every patch's sections of it, reversed, in reverse order."""
    files = {rel: split_lines(data.decode())}
    for patch in reversed(patches):
        sections = [fp for fp in patch.files if fp.path == rel]
        if sections:
            apply_patch(files, Patch(patch.name, "", sections[::-1]), reverse=True)
    if sha256_bytes("".join(files[rel]).encode()) != pristine_sha256:
        raise OverlayError(f"{rel}: reversing the queue does not give back the pristine file")
    return files[rel]


def _check_version(sglang_root: Path, pin: Pin) -> None:
    if not sglang_root.is_dir():
        raise OverlayError(f"--sglang-root {sglang_root} is not a directory")
    found = tree_version(sglang_root)
    if found != pin.version:
        raise OverlayError(
            f"upstream version mismatch in {sglang_root}: expected {pin.package} {pin.version} (UPSTREAM.toml), found {found}"
        )


def apply_queue(sglang_root: Path, queue_root: Path) -> str:
    """Apply the queue in-tree to ``sglang_root``; return what happened (a no-op when already applied)."""
    pin = load_pin(queue_root)
    _check_version(sglang_root, pin)
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
    try:
        record, unreadable = read_record(sglang_root), ""
    except CorruptRecord as exc:  # harmless on a pristine tree, which the record no longer describes
        record, unreadable = None, str(exc)
    found = {rel: sha256_bytes(data) for rel, data in current.items()}
    if (
        record
        and record.state == APPLIED
        and record.queue_sha256 == queue_sha
        and all(found[rel] == record.patched_sha256(rel) for rel in current)
    ):
        return f"already applied: {len(patches)} patches (queue {queue_sha[:12]}) in {sglang_root}; nothing to do"
    interrupted = record is not None and record.state == APPLYING
    resume = interrupted and record.queue_sha256 == queue_sha
    texts: dict[str, list[str]] = {}
    mismatched: list[tuple[str, str, str]] = []
    for rel, data in current.items():
        if found[rel] == pristine[rel]:
            texts[rel] = split_lines(data.decode())
        elif resume and found[rel] == record.patched_sha256(rel):
            texts[rel] = _unpatched(rel, data, patches, pristine[rel])
        else:
            mismatched.append((rel, pristine[rel], found[rel]))
    if mismatched:
        raise OverlayError(_not_pristine(sglang_root, pin, record, unreadable, mismatched))
    already = [rel for rel in current if found[rel] != pristine[rel]]
    if resume:
        log(
            f"{sglang_root}: finishing an interrupted apply of this queue ({RECORD_NAME} says '{APPLYING}'): "
            f"{len(already)} of {len(current)} files were patched"
        )
    for patch in patches:
        apply_patch(texts, patch)
    new_bytes = {rel: "".join(lines).encode() for rel, lines in texts.items()}
    files = {
        rel: {"pristine_sha256": pristine[rel], "patched_sha256": sha256_bytes(new_bytes[rel])}
        for rel in sorted(new_bytes)
    }
    _write_record(sglang_root, APPLYING, pin, queue, files)
    for rel, data in new_bytes.items():
        write_if_changed(sglang_root / rel, data)
    _write_record(sglang_root, APPLIED, pin, queue, files)
    return f"applied {len(patches)} patches ({len(new_bytes)} files, queue {queue_sha[:12]}) to {sglang_root}; recorded in {RECORD_NAME}"


def _not_pristine(
    sglang_root: Path, pin: Pin, record: Record | None, unreadable: str, mismatched: list[tuple[str, str, str]]
) -> str:
    def state(rel: str, got: str) -> str:
        if record is None or rel not in record.files:
            return ""
        if record.patched_sha256(rel) == got:
            return (
                " (as an interrupted apply left it)"
                if record.state == APPLYING
                else " (as the recorded overlay left it)"
            )
        return " (changed after the recorded overlay)"

    detail = "\n  ".join(
        f"{rel}: expected pristine sha256 {want}, found {got}{state(rel, got)}" for rel, want, got in mismatched
    )
    reinstall = f"reinstall pristine {pin.package}=={pin.version}, then apply"
    if record is not None and record.state == APPLYING:
        why = f" (an interrupted apply of another queue, {record.queue_sha256[:12]}, left them so: {reinstall})"
    elif record is not None:
        why = f" (the tree records overlay queue {record.queue_sha256[:12]}; {reinstall})"
    elif unreadable:
        why = f" (and {unreadable}; {reinstall})"
    else:
        why = ""
    return f"touched files in {sglang_root} are not the pinned {pin.version} originals{why}:\n  {detail}"


def verify_tree(sglang_root: Path, queue_root: Path) -> str:
    """Check that ``sglang_root`` carries exactly the queue at ``queue_root``, as its record says; raise naming what differs."""
    pin = load_pin(queue_root)
    _check_version(sglang_root, pin)
    queue = load_queue(queue_root)
    require_valid(queue, pin)
    reinstall = f"reinstall pristine {pin.package}=={pin.version}, then `overlay apply`"
    try:
        record = read_record(sglang_root)
    except CorruptRecord as exc:
        raise OverlayError(f"{exc}: {reinstall}") from exc
    if record is None:
        raise OverlayError(
            f"{sglang_root} has no {RECORD_NAME}: the patch queue was never applied to it (`overlay apply`)"
        )
    patched = [rel for rel, h in record.files.items() if _sha256_or_none(sglang_root / rel) == h["patched_sha256"]]
    if record.state == APPLYING:
        raise OverlayError(
            f"{sglang_root}: an interrupted apply: {RECORD_NAME} says '{APPLYING}' (queue {record.queue_sha256[:12]}), "
            f"{len(patched)} of {len(record.files)} files were patched; run `overlay apply` again to finish it"
        )
    problems = []
    if record.upstream != f"{pin.package}=={pin.version}":
        problems.append(f"the record is of {record.upstream}, the pin is {pin.package}=={pin.version}")
    if record.queue_sha256 != queue.sha256():
        problems.append(
            f"the tree carries queue {record.queue_sha256[:12]} ({len(record.patches)} patches), {queue_root} has "
            f"queue {queue.sha256()[:12]} ({len(queue.series)} patches): {reinstall}"
        )
    if set(record.files) != set(queue.manifest["pristine_sha256"]):
        problems.append(
            f"the record lists {sorted(record.files)}, the queue touches {sorted(queue.manifest['pristine_sha256'])}"
        )
    for rel, hashes in sorted(record.files.items()):
        got = _sha256_or_none(sglang_root / rel)
        if got is None:
            problems.append(f"{rel}: missing")
        elif got == hashes["pristine_sha256"] != hashes["patched_sha256"]:
            problems.append(f"{rel}: pristine again (the overlay was undone, e.g. by a reinstall): {reinstall}")
        elif got != hashes["patched_sha256"]:
            problems.append(f"{rel}: sha256 {got}, the overlay left {hashes['patched_sha256']} (changed since)")
    if problems:
        raise OverlayError(f"{sglang_root} does not carry the recorded overlay:\n  " + "\n  ".join(problems))
    return (
        f"verified {sglang_root}: {record.upstream} with {len(record.patches)} patches "
        f"(queue {record.queue_sha256[:12]}), {len(patched)} files as recorded"
    )


def _sha256_or_none(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def check_queue(root: Path, wheel: Path | None = None) -> str:
    """Validate the queue and prove it applies (strictly, then idempotently, then verifiably) to the pinned wheel."""
    pin = load_pin(root)
    queue = load_queue(root)
    require_valid(queue, pin)
    if wheel is None:
        wheel = pinned_wheel(root, pin)
    else:
        if not wheel.is_file():
            raise OverlayError(f"--wheel {wheel}: no such file")
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
        verify_tree(tree, root)
    return f"ok: {len(queue.series)} patches, {len(touched)} upstream files, apply cleanly to {wheel.name}"
