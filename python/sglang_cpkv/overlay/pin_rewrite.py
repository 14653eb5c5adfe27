"""Moving the pin: ``UPSTREAM.toml`` rewritten with tomlkit, and every other file of the repo that names the version.

``UPSTREAM.toml`` is the one source of truth, but a Dockerfile ``ARG``, a compose image tag, a pip extra
and the documented commands (README.md, docs/operations.md) cannot read it, so they carry the version as text; ``rebase`` rewrites each of
them (:data:`VERSION_REFERENCES` in :data:`VERSION_REFERENCE_FILES` and every file under
:data:`VERSION_REFERENCE_DIRS`) together with the pin, and a test fails when one of them disagrees.

Only ``rebase`` imports this module: tomlkit is a development requirement, and ``apply`` / ``verify``
must run in the image without it.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomlkit
from tomlkit.exceptions import ParseError
from tomlkit.items import String, Table

from sglang_cpkv.overlay.common import OverlayError
from sglang_cpkv.overlay.pin import PIN_FILE, WheelPin

VERSION_REFERENCE_FILES = ("README.md", "docs/operations.md", "python/pyproject.toml")
VERSION_REFERENCE_DIRS = ("docker",)
_VERSION = r"\d+(?:\.\d+)+(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?"
VERSION_REFERENCES = (
    re.compile(rf"\b(sglang==)({_VERSION})"),  # a pip requirement (pyproject's extra, the README, the label)
    re.compile(rf"(\bsglang:v)({_VERSION})"),  # upstream's release image, lmsysorg/sglang:vX.Y.Z-cu130
    re.compile(rf"\b(sglang-cpkv:)({_VERSION})"),  # our image, tagged with the upstream version
)


def rewrite_versions(text: str, old: str, new: str) -> str:
    """``text`` with every :data:`VERSION_REFERENCES` match that names ``old`` naming ``new`` instead."""
    for pattern in VERSION_REFERENCES:
        text = pattern.sub(lambda m: m.group(1) + (new if m.group(2) == old else m.group(2)), text)
    return text


def version_reference_files(root: Path) -> list[Path]:
    """The files under ``root`` that may name the pinned version (those that exist: a test queue root has none)."""
    files = [root / rel for rel in VERSION_REFERENCE_FILES if (root / rel).is_file()]
    for rel in VERSION_REFERENCE_DIRS:
        files += sorted(p for p in (root / rel).rglob("*") if p.is_file()) if (root / rel).is_dir() else []
    return files


def rewrite_version_references(root: Path, old: str, new: str) -> dict[Path, tuple[str, str]]:
    """``path -> (text, rewritten text)`` for every reference file whose text names ``old``."""
    changed = {}
    for path in version_reference_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text: names no version
        rewritten = rewrite_versions(text, old, new)
        if rewritten != text:
            changed[path] = (text, rewritten)
    return changed


def _set_string(table: Table, key: str, value: str, where: str) -> None:
    """Set ``table[key]`` to ``value`` in the quoting form (basic, literal, multi-line) the file uses for it."""
    if key not in table:
        raise OverlayError(f"{PIN_FILE}: [{where}] has no {key}")
    old = table[key]
    table[key] = String.from_raw(value, type_=old.type) if isinstance(old, String) else value


def rewrite_pin_toml(text: str, old: str, new: str, wheels: dict[str, WheelPin], kernels: dict[str, str]) -> str:
    """The pin moved from ``old`` to ``new``, every comment and the layout kept.

    Sets ``[upstream] version``, each ``[upstream.wheels.TAG]`` filename and sha256, each ``[kernels]``
    entry named in ``kernels``, and the version references inside ``[image]``.
    """
    try:
        doc = tomlkit.parse(text)
    except ParseError as exc:
        raise OverlayError(f"{PIN_FILE}: not valid TOML ({exc})") from exc
    upstream = doc["upstream"]
    _set_string(upstream, "version", new, "upstream")
    for tag, wheel in wheels.items():
        table = upstream["wheels"][tag]
        _set_string(table, "filename", wheel.filename, f"upstream.wheels.{tag}")
        _set_string(table, "sha256", wheel.sha256, f"upstream.wheels.{tag}")
    for name, version in kernels.items():
        _set_string(doc["kernels"], name, version, "kernels")
    image = doc.get("image", {})
    for key, value in list(image.items()):
        if isinstance(value, str):
            _set_string(image, key, rewrite_versions(value, old, new), "image")
    return tomlkit.dumps(doc)
