"""Pristine and patched trees of the pinned upstream, for comparing their behaviour in tests.

A test that compares "upstream as pinned" with "upstream with our queue" needs both side by side without touching
the install: a tree here is a directory holding an ``sglang`` package of symlinks to the installed files, except that
every file the queue touches is real: the wheel's pristine bytes (:func:`pristine_tree`), then the queue applied
(:func:`patched_tree`); about a second to build. Import it in a subprocess with the tree first on ``PYTHONPATH``
(:mod:`.resolve_server_args`). A directory without a touched file links its ``__pycache__`` to the install's, so
untouched modules compile once. Used by ``integration/test_cp_shared_kv_server_args.py`` and
``upstream/test_upstream_consistency_rules.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_cpkv.overlay.common import PACKAGE_DIR
from sglang_cpkv.overlay.pin import find_queue_root, load_pin
from sglang_cpkv.overlay.queue import load_queue
from sglang_cpkv.overlay.tree import RECORD_NAME, apply_queue, installed_sglang_root
from sglang_cpkv.overlay.wheels import pinned_wheel, read_wheel_files


def pristine_tree(dest: Path) -> Path:
    """``dest/sglang``: the installed tree with every queue-touched file restored from the pinned wheel.

    Returns ``dest`` (the directory to put on ``PYTHONPATH``).
    """
    root = find_queue_root()
    queue = load_queue(root)
    wheel = pinned_wheel(root, load_pin(root))
    package = dest / PACKAGE_DIR
    touched = sorted(set(queue.manifest.get("pristine_sha256", {})) | set(queue.touched()))
    _symlink_tree(installed_sglang_root(), package, {str(Path(rel).parent) for rel in touched})
    for rel, data in read_wheel_files(wheel, touched).items():
        if data is None:
            raise RuntimeError(f"the pinned wheel {wheel.name} has no sglang/{rel}, which the queue touches")
        target = package / rel
        target.unlink()
        target.write_bytes(data)
    record = package / RECORD_NAME
    if record.is_symlink() or record.exists():
        record.unlink()
    return dest


def patched_tree(dest: Path) -> Path:
    """``dest/sglang``: :func:`pristine_tree` with the whole queue applied. Returns ``dest``."""
    pristine_tree(dest)
    apply_queue(dest / PACKAGE_DIR, find_queue_root())
    return dest


def _symlink_tree(src: Path, dst: Path, dirs_with_touched_files: set[str]) -> None:
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            os.symlink(Path(dirpath) / name, dst / rel / name)
        if str(rel) not in dirs_with_touched_files and any(n.endswith(".py") for n in filenames):
            cache = Path(dirpath) / "__pycache__"
            cache.mkdir(exist_ok=True)
            os.symlink(cache, dst / rel / "__pycache__")
