"""Every copy of an upstream version outside ``UPSTREAM.toml``, for the tests that hold them to the pin.

The patterns are broader than the rebase tool's own (:mod:`sglang_cpkv.overlay.pin_rewrite`), so a copy
written in a form the tool would not move still fails the test: ``sglang==X`` and ``sglang === X``
requirements, ``sglang:vX`` image tags, our ``sglang-cpkv:X`` tag, and prose such as ``SGLang X.Y.Z``.
"""

from __future__ import annotations

import re
from pathlib import Path

SCANNED_FILES = ("README.md", "docs/operations.md", "python/pyproject.toml")
SCANNED_DIRS = ("docker",)
COPY_PATTERNS = (
    re.compile(r"\bsglang\s*===?\s*v?(\d[\w.+!]*)", re.I),
    re.compile(r"\bsglang:v?(\d[\w.]*)", re.I),
    re.compile(r"\bsglang-cpkv:v?(\d[\w.]*)", re.I),
    re.compile(r"\bsglang\s+v?(\d+\.\d+\.\d+[\w.]*)", re.I),
)


def scanned_files(root: Path) -> list[Path]:
    files = [root / rel for rel in SCANNED_FILES if (root / rel).is_file()]
    for rel in SCANNED_DIRS:
        if (root / rel).is_dir():
            files += sorted(p for p in (root / rel).rglob("*") if p.is_file())
    return files


def version_copies(root: Path) -> list[tuple[str, int, str]]:
    """``(file relative to root, line number, version)`` of every copy found."""
    found = []
    for path in scanned_files(root):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern in COPY_PATTERNS:
                for match in pattern.finditer(line):
                    found.append((path.relative_to(root).as_posix(), number, match.group(1).rstrip(".")))
    return found
