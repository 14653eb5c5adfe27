"""What every job of the overlay tool shares: the user-facing error, the log, hashing, atomic writes."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = "sglang"  # upstream's package directory: in its wheels, in installed trees, in patch paths


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


def write_if_changed(path: Path, data: bytes) -> bool:
    """``write_atomic`` unless ``path`` already holds ``data`` (a no-op leaves the file's bytes and mtime alone)."""
    if path.is_file() and path.read_bytes() == data:
        return False
    write_atomic(path, data)
    return True
