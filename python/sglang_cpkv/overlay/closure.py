"""Upstream's import closure pinned outside ``UPSTREAM.toml``: the requirement files ``rebase`` moves with the pin.

``UPSTREAM.toml``'s ``[closure]`` names each file that pins packages the upstream wheel requires, with its Python
tags. A rebase keeps a pin the new release allows, keeps a deliberate divergence (a pin the old release did not
allow either: the CPU torch), and moves any other to the newest non-yanked version the new requirement allows with
a wheel for each tag (one version for every file), else flags it and changes nothing. A file installed
``--no-deps`` is not resolved again. Only :mod:`.rebase` imports this module; the procedure: ``docs/rebase.md``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from sglang_cpkv.overlay.common import OverlayError
from sglang_cpkv.overlay.pin import PIN_FILE, Pin
from sglang_cpkv.overlay.wheels import IndexFile, plain_requirements

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_HASHES = re.compile(r"(\s+)--hash[=\s]\s*sha256:[0-9a-fA-F]+(?:\s+--hash[=\s]\s*sha256:[0-9a-fA-F]+)*")
_HASH = re.compile(r"--hash[=\s]\s*sha256:([0-9a-fA-F]+)")
_COMMENT = re.compile(r"(?:^|\s)#")  # pip: a comment starts at a '#' that opens the line or follows whitespace
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


@dataclasses.dataclass(frozen=True)
class ClosurePin:
    """One exact pin of a closure file."""

    file: str  # relative to the queue root
    line: int
    name: str  # normalized
    version: str
    hashed: bool


@dataclasses.dataclass(frozen=True)
class ClosureEntry:
    """A pin whose package the new release requires in a way the pin does not meet, and what the rebase does."""

    pin: ClosurePin
    required: str  # the new release's specifier
    action: str  # moved | kept | flagged
    detail: str  # moved: why this version; kept: the old requirement; flagged: why no version was chosen
    version: str = ""  # moved: the new version
    hashes: tuple[str, ...] = ()  # moved, for a hashed pin


def closure_files(pin_text: str, pin: Pin) -> dict[str, list[str]]:
    """``file -> Python tags`` of the pin's ``[closure]`` table (empty without one)."""
    table = tomllib.loads(pin_text).get("closure", {})
    if not isinstance(table, dict):
        raise OverlayError(f"{PIN_FILE}: [closure] must be a table of 'file = [python tags]'")
    for rel, tags in table.items():
        if not isinstance(tags, list) or not tags or not all(isinstance(t, str) for t in tags):
            raise OverlayError(f'{PIN_FILE}: [closure] "{rel}" must list Python tags, e.g. ["cp311"]')
        unpinned = [t for t in tags if t not in pin.wheels]
        if unpinned:
            raise OverlayError(
                f'{PIN_FILE}: [closure] "{rel}" names {", ".join(unpinned)}, which [upstream.wheels] does not pin'
            )
    return table


def read_pins(root: Path, rel: str) -> list[ClosurePin]:
    """The exact pins of requirement file ``rel``: ``name==X`` (extras, markers and ``--hash`` options allowed)."""
    path = root / rel
    if not path.is_file():
        raise OverlayError(f'{PIN_FILE}: [closure] names "{rel}", which does not exist')
    return _pins(rel, path.read_text(encoding="utf-8"))


def _pins(rel: str, text: str) -> list[ClosurePin]:
    pins = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.split(raw, maxsplit=1)[0].strip()
        if not line or line.startswith("-"):  # an option line: -r, -c, --index-url ...
            continue
        if line.endswith("\\"):
            raise OverlayError(f"{rel}:{number}: a continued line; write each requirement on one line")
        try:
            req = Requirement(re.split(r"\s+--", line, maxsplit=1)[0])
        except InvalidRequirement as exc:
            raise OverlayError(f"{rel}:{number}: not a requirement the rebase can read ({exc})") from exc
        specs = list(req.specifier)
        if req.url is None and len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
            pins.append(
                ClosurePin(rel, number, canonicalize_name(req.name), specs[0].version, bool(_HASH.search(line)))
            )
    return pins


def _required(wheel: Path, targets: list[tuple[str, str]]) -> dict[str, SpecifierSet]:
    """``name -> specifier`` of what ``wheel`` requires on any of ``targets`` (``(tag, platform)``)."""
    specs: dict[str, SpecifierSet] = {}
    for tag, platform in targets:
        for req in plain_requirements(wheel, tag, platform):
            name = canonicalize_name(req.name)
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
    return specs


def _platforms(platform: str) -> list[str]:
    """The platform tags a ``platform`` machine installs, most specific first (as pip orders them)."""
    match = re.match(r"^manylinux_2_(\d+)_(\w+)$", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    out = []
    for minor in range(glibc, 4, -1):
        out.append(f"manylinux_2_{minor}_{arch}")
        if minor in _LEGACY_MANYLINUX:
            out.append(f"{_LEGACY_MANYLINUX[minor]}_{arch}")
    return out


def _supported(tag: str, platform: str) -> list[Tag]:
    """The wheel tags a CPython ``tag`` on ``platform`` installs, pip's preference first."""
    python = (int(tag[2]), int(tag[3:]))
    platforms = _platforms(platform)
    return [*cpython_tags(python, [tag], platforms), *compatible_tags(python, tag, platforms)]


def _allows_python(file: IndexFile, tag: str) -> bool:
    try:
        return file.requires_python is None or SpecifierSet(file.requires_python).contains(f"{tag[2]}.{tag[3:]}")
    except InvalidSpecifier:
        return False


def choose_version(
    spec: SpecifierSet, targets: list[tuple[str, str]], files: list[IndexFile]
) -> tuple[str, dict[str, IndexFile]] | None:
    """The newest version ``spec`` allows with a wheel for every ``(tag, platform)``, and that wheel per tag."""
    by_version: dict[Version, list[tuple[IndexFile, frozenset[Tag]]]] = {}
    for file in files:
        if file.yanked or not file.filename.endswith(".whl"):
            continue
        try:
            _, version, _, tags = parse_wheel_filename(file.filename)
        except InvalidWheelFilename:
            continue
        by_version.setdefault(version, []).append((file, tags))
    # a pre-release only where the specifier names one (packaging's default would take one here)
    allowed = [v for v in by_version if spec.contains(v, prereleases=bool(spec.prereleases))]
    for version in sorted(allowed, reverse=True):
        chosen = {}
        for tag, platform in targets:
            rank = {t: i for i, t in enumerate(_supported(tag, platform))}
            usable = [
                (min(rank[t] for t in tags & rank.keys()), f.filename, f)
                for f, tags in by_version[version]
                if tags & rank.keys() and _allows_python(f, tag)
            ]
            if not usable:
                break
            chosen[tag] = min(usable, key=lambda u: u[:2])[2]
        else:
            return str(version), chosen
    return None


def plan_closure(
    root: Path,
    pin: Pin,
    files: dict[str, list[str]],
    old_wheel: Path,
    new_wheel: Path,
    lookup: Callable[[str], list[IndexFile]],
) -> list[ClosureEntry]:
    """What the rebase does with each pin of the closure ``files`` (:func:`closure_files`) that the new
    release's requirements do not allow.

    ``lookup(package)`` lists the index's files (:func:`sglang_cpkv.overlay.wheels.index_files`); it is
    called only for the packages that must move.
    """
    kept, to_move = [], []
    for rel, tags in files.items():
        targets = [(tag, pin.wheels[tag].platform) for tag in tags]
        new_required, old_required = _required(new_wheel, targets), _required(old_wheel, targets)
        for p in read_pins(root, rel):
            spec = new_required.get(p.name)
            if spec is None or spec.contains(p.version, prereleases=True):
                continue
            old_spec = old_required.get(p.name)
            if old_spec is not None and not old_spec.contains(p.version, prereleases=True):
                kept.append(ClosureEntry(p, str(spec), "kept", f"`{old_spec}`"))
            else:
                to_move.append((p, spec, targets))
    choices = {}
    for name in dict.fromkeys(p.name for p, _, _ in to_move):
        spec = SpecifierSet()
        targets = []
        for p, s, t in to_move:
            if p.name == name:
                spec &= s
                targets += [target for target in t if target not in targets]
        choices[name] = (spec, targets, choose_version(spec, targets, lookup(name)))
    entries = list(kept)
    for p, own_spec, own_targets in to_move:
        spec, targets, choice = choices[p.name]
        if choice is None:
            tags = ", ".join(tag for tag, _ in targets)
            why = f"no version on the index that `{spec}` allows, not yanked, has a wheel for each of {tags}"
            entries.append(ClosureEntry(p, str(own_spec), "flagged", why))
            continue
        version, wheels = choice
        own = [wheels[tag] for tag, _ in own_targets]
        names = ", ".join(dict.fromkeys(w.filename for w in own))
        if p.hashed and not all(w.sha256 for w in own):
            entries.append(ClosureEntry(p, str(own_spec), "flagged", f"the index publishes no sha256 for {names}"))
            continue
        hashes = tuple(dict.fromkeys(w.sha256 for w in own)) if p.hashed else ()
        detail = f"the newest version `{spec}` allows with a wheel for each of {', '.join(t for t, _ in targets)}"
        entries.append(ClosureEntry(p, str(own_spec), "moved", f"{detail} ({names})", version, hashes))
    return sorted(entries, key=lambda e: (e.pin.file, e.pin.line))


def _moved_line(line: str, entry: ClosureEntry) -> str:
    version = re.compile(rf"(===?\s*){re.escape(entry.pin.version)}(?=[\s;,]|$)")
    line = version.sub(lambda m: m.group(1) + entry.version, line, count=1)
    new_hashes = " ".join(f"--hash=sha256:{h}" for h in entry.hashes)
    return _HASHES.sub(lambda m: m.group(1) + new_hashes, line, count=1) if entry.hashes else line


def rewrite_closure(root: Path, entries: list[ClosureEntry]) -> dict[Path, tuple[str, str]]:
    """``path -> (text, rewritten text)`` of every closure file with a moved pin, each checked by reading it back."""
    moves = [e for e in entries if e.action == "moved"]
    changed = {}
    for rel in dict.fromkeys(e.pin.file for e in moves):
        text = (root / rel).read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for e in moves:
            if e.pin.file == rel:
                lines[e.pin.line - 1] = _moved_line(lines[e.pin.line - 1], e)
        rewritten = "".join(lines)
        got = {p.line: p for p in _pins(rel, rewritten)}
        for e in moves:
            if e.pin.file != rel:
                continue
            read_back = got.get(e.pin.line)
            hashes = tuple(_HASH.findall(lines[e.pin.line - 1]))
            if (
                read_back is None
                or (read_back.name, read_back.version) != (e.pin.name, e.version)
                or (e.hashes and hashes != e.hashes)
            ):
                raise OverlayError(
                    f"rewriting {rel}:{e.pin.line} went wrong: it would read {lines[e.pin.line - 1].strip()!r}, "
                    f"expected {e.pin.name}=={e.version}; nothing was changed"
                )
        changed[root / rel] = (text, rewritten)
    return changed
