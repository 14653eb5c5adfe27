"""The roles' log files: one per launch, rotated by size, pruned by count, written so that a failing disk never
stalls a server.

A launch writes ``PD_LOG_DIR/<role>-<time>-<pid>.log`` (0640; ``<role>.log`` links to the newest). When a
file would grow past ``PD_LOG_MAX_BYTES`` it is renamed ``.1`` (``.1`` to ``.2``, ...; ``PD_LOG_KEEP``
rotated files are kept), and a new launch leaves only the ``PD_LOG_KEEP`` newest launch logs of its role.
A write that fails (a full disk, a removed directory) drops that output and counts it: the server's
output keeps being read, so the server never blocks on a full pipe. The first failure is reported on
stderr; once writing works again the log says how much was lost.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from sglang_cpkv.pd_launch.config import PDConfig, PDLaunchError

LOG_FILE_MODE = 0o640
LOG_DIR_MODE = 0o750


def open_private(path: Path, mode: int, flags: int = os.O_TRUNC) -> int:
    """A write-only fd of ``path``, created (or narrowed) to ``mode`` whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, mode)
    os.fchmod(fd, mode)
    return fd


def ensure_log_dir(cfg: PDConfig) -> None:
    try:
        cfg.log_dir.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise PDLaunchError(
            f"PD_LOG_DIR={cfg.log_dir}: cannot create it ({exc.strerror or exc}): the logs and pid records go there"
        ) from None
    if not os.access(cfg.log_dir, os.W_OK | os.X_OK):
        raise PDLaunchError(f"PD_LOG_DIR={cfg.log_dir} is not writable: the logs and pid records go there")


def _launch_logs(cfg: PDConfig, role: str) -> list[Path]:
    """The role's launch logs, oldest first (their names sort by time)."""
    return sorted(p for p in cfg.log_dir.glob(f"{role}-*.log") if p.is_file())


def new_log(cfg: PDConfig, role: str) -> Path:
    """A new launch log for ``role`` (``<role>.log`` points at it); older launch logs beyond PD_LOG_KEEP removed."""
    ensure_log_dir(cfg)
    path = cfg.log_dir / f"{role}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    older = _launch_logs(cfg, role)
    for old in older[: max(0, len(older) - (cfg.log_keep - 1))]:
        for rotated in [old, *old.parent.glob(old.name + ".*")]:
            rotated.unlink(missing_ok=True)
    os.close(open_private(path, LOG_FILE_MODE))
    latest = cfg.log_dir / f"{role}.log"
    latest.unlink(missing_ok=True)
    latest.symlink_to(path.name)
    return path


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


class LogSink:
    """Appends to one launch log, rotating it by size; never raises on a failed write.

    ``echo``: also copy everything to this process's stdout (a foreground role: `docker logs`). A stdout
    that goes away (a closed terminal) ends the echo, not the drain.
    """

    def __init__(self, path: Path, max_bytes: int, keep: int, echo: bool):
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.echo = echo
        self.dropped = 0  # bytes of output not written since the last successful write
        self._warned = False
        self._fd: int | None = None
        self._size = 0
        self._open()

    def _open(self) -> None:
        try:
            self._fd = open_private(self.path, LOG_FILE_MODE, os.O_APPEND)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            self._fd = None
            self._failed(0, exc)

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = None
        for n in range(self.keep, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if n == self.keep:
                older.unlink(missing_ok=True)
            else:
                newer = older.with_name(f"{self.path.name}.{n + 1}")
                if older.exists():
                    older.rename(newer)
        self.path.rename(self.path.with_name(self.path.name + ".1"))
        self._open()

    def _failed(self, nbytes: int, exc: OSError) -> None:
        self.dropped += nbytes
        if not self._warned:
            self._warned = True
            reason = errno.errorcode.get(exc.errno, "") or type(exc).__name__
            print(
                f"[pd_launch] writing {self.path} failed ({reason}: {exc.strerror or exc}); the server's output is "
                "dropped (and counted) until writing works again",
                file=sys.stderr,
                flush=True,
            )

    def _write_file(self, data: bytes, counted: bool = True) -> bool:
        try:
            if self._fd is None:
                self._open()
                if self._fd is None:
                    return False
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
                if self._fd is None:
                    return False
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
                self._size += written
            return True
        except OSError as exc:
            self._failed(len(data) if counted else 0, exc)
            return False

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self.echo:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            except (OSError, ValueError):
                self.echo = False  # the terminal or pipe is gone: the log still gets everything
        if self.dropped and self._write_file(
            f"[pd_launch] {self.dropped} bytes of output were dropped: writing this log failed\n".encode(),
            counted=False,
        ):
            self.dropped = 0
        self._write_file(data)

    def note(self, message: str) -> None:
        """A line of the launcher's own, in the log (and on stderr when echoing)."""
        line = f"[pd_launch] {message}\n"
        if self.echo:
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        self._write_file(line.encode(), counted=False)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
