"""Process lifecycle of the roles: start (background), run (foreground), wait, status, stop.

Every role runs in a process group of its own (the role and everything it spawns: schedulers,
detokenizer), so that stopping it ends exactly that group: SIGTERM, then SIGKILL after
``PD_STOP_TIMEOUT``, in the background and in the foreground alike. ``start`` records the group in
``PD_LOG_DIR/<role>.pid`` (0600) beside the role's log (0640); both hold the command with secret values
redacted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from sglang_cpkv.pd_launch.commands import build_command, role_env
from sglang_cpkv.pd_launch.config import PDConfig, PDLaunchError, require_role
from sglang_cpkv.pd_launch.redaction import redact_argv, redact_env_value

# Environment variables worth recording in a log header: they change how NCCL, the KV transfer engine
# and upstream behave, and are the first thing to compare when two launches differ.
RECORDED_ENV_PREFIXES = ("PD_", "NCCL_", "MC_", "UCX_", "SGLANG_", "CUDA_", "NVSHMEM_", "GLOO_")
PID_FILE_MODE = 0o600
LOG_FILE_MODE = 0o640
LOG_DIR_MODE = 0o750
KILL_WAIT_S = 10.0  # after SIGKILL: how long the kernel may take to reap the group


def _log(message: str) -> None:
    print(f"[pd_launch] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class _ProcStat:
    state: str
    pgrp: int
    start_time: int  # clock ticks since boot: tells a recycled pid from the process we started


def _proc_stat(pid: int) -> _ProcStat | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return _ProcStat(state=fields[0], pgrp=int(fields[2]), start_time=int(fields[19]))


def _live_group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` that are not zombies (a container may have no init to reap them)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat and stat.pgrp == pgid and stat.state != "Z":
                members.append(int(entry.name))
    return members


# --------------------------------------------------------------------------------------------
# Records and logs


def _pid_file(cfg: PDConfig, role: str) -> Path:
    return cfg.log_dir / f"{role}.pid"


def _open_private(path: Path, mode: int):
    """Open ``path`` for writing, created (or narrowed) to ``mode`` whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    return os.fdopen(fd, "w")


def log_header(role: str, argv: Sequence[str], added_env: Mapping[str, str]) -> str:
    env = {k: v for k, v in sorted({**os.environ, **added_env}.items()) if k.startswith(RECORDED_ENV_PREFIXES)}
    lines = [
        f"# pd_launch {role} at {time.strftime('%Y-%m-%d %H:%M:%S %Z')} on {os.uname().nodename}",
        f"# command: {shlex.join(redact_argv(argv))}",
    ]
    lines += [f"# env {k}={redact_env_value(k, v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _new_log(cfg: PDConfig, role: str) -> Path:
    cfg.log_dir.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
    path = cfg.log_dir / f"{role}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    latest = cfg.log_dir / f"{role}.log"
    latest.unlink(missing_ok=True)
    latest.symlink_to(path.name)
    return path


def _read_pid_record(cfg: PDConfig, role: str) -> dict | None:
    path = _pid_file(cfg, role)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise PDLaunchError(f"{path} is not a pid record written by pd_launch; inspect and remove it") from None


def _record_alive(record: dict) -> bool:
    """True while the process group ``start`` recorded still has live members.

    A pid can be recycled only once its process group is empty, so a leader pid that now belongs to a
    process with another start time means our group is gone (and that group id is someone else's).
    """
    leader = _proc_stat(record["pid"])
    if leader is not None and leader.start_time != record["start_time"]:
        return False
    return bool(_live_group_members(record["pgid"]))


# --------------------------------------------------------------------------------------------
# Health


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(role: str, cfg: PDConfig, pid: int | None = None) -> None:
    """Poll ``role``'s /health until it answers 200, the process exits, or PD_HEALTH_TIMEOUT passes."""
    url = cfg.health_url(role)
    started = time.monotonic()
    deadline = started + cfg.health_timeout
    _log(f"waiting for {role} at {url} (up to {cfg.health_timeout:.0f}s)")
    while True:
        if _health_ok(url):
            _log(f"{role} is healthy")
            return
        leader = _proc_stat(pid) if pid is not None else None
        if pid is not None and (leader is None or leader.state == "Z"):
            raise PDLaunchError(f"{role} exited before it became healthy (see {cfg.log_dir / (role + '.log')})")
        if time.monotonic() >= deadline:
            raise PDLaunchError(f"{role} not healthy at {url} after {cfg.health_timeout:.0f}s (PD_HEALTH_TIMEOUT)")
        interval = 0.5 if time.monotonic() - started < 10 else 2.0  # quick for a quick start, then gentle
        time.sleep(min(interval, max(0.1, deadline - time.monotonic())))


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# Start, stop, status


def start(role: str, cfg: PDConfig, wait: bool = True) -> int:
    """Start ``role`` in its own process group, logging to PD_LOG_DIR; record its pid; wait for health."""
    require_role(role)
    existing = _read_pid_record(cfg, role)
    if existing and _record_alive(existing):
        raise PDLaunchError(f"{role} already runs (pid {existing['pid']}, {_pid_file(cfg, role)}); stop it first")
    argv = build_command(role, cfg)
    log_path = _new_log(cfg, role)
    with _open_private(log_path, LOG_FILE_MODE) as log_file:
        log_file.write(log_header(role, argv, role_env(role, cfg)))
        log_file.flush()
        # start_new_session: the role and every process it spawns share one process group that `stop`
        # can end without touching anything else on the host.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **role_env(role, cfg)},
        )
    leader = _proc_stat(proc.pid)
    record = {
        "role": role,
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_time": leader.start_time if leader else None,
        "argv": redact_argv(argv),
        "log": str(log_path),
    }
    with _open_private(_pid_file(cfg, role), PID_FILE_MODE) as pid_file:
        pid_file.write(json.dumps(record, indent=1) + "\n")
    _log(f"started {role}: pid {proc.pid}, log {log_path}")
    if wait:
        try:
            wait_healthy(role, cfg, proc.pid)
        except PDLaunchError:
            _log(f"last lines of {log_path}:\n{_tail(log_path)}")
            stop([role], cfg)
            raise
    return proc.pid


def _end_group(role: str, pgid: int, grace_s: float) -> None:
    """SIGTERM process group ``pgid``, then SIGKILL what is left after ``grace_s``."""
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + grace
        while _live_group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _live_group_members(pgid):
            return
        _log(f"{role}: process group {pgid} still alive after {signal.Signals(sig).name} + {grace:.0f}s")
    raise PDLaunchError(f"{role}: process group {pgid} survived SIGKILL: pids {_live_group_members(pgid)}")


def stop(roles: Sequence[str], cfg: PDConfig) -> None:
    """End the process groups that ``start`` recorded: SIGTERM, then SIGKILL after PD_STOP_TIMEOUT."""
    for role in roles:
        require_role(role)
        record = _read_pid_record(cfg, role)
        if record is None:
            _log(f"{role}: no pid record in {cfg.log_dir} (PD_LOG_DIR); nothing to stop")
            continue
        pgid = record["pgid"]
        if not _record_alive(record):
            _log(f"{role}: pid {record['pid']} already gone")
            _pid_file(cfg, role).unlink(missing_ok=True)
            continue
        _end_group(role, pgid, cfg.stop_timeout)
        _pid_file(cfg, role).unlink(missing_ok=True)
        _log(f"{role}: stopped (process group {pgid})")


def status(roles: Sequence[str], cfg: PDConfig, out=sys.stdout) -> bool:
    """Print each role's recorded process and health; True when all of them are healthy."""
    all_ok = True
    for role in roles:
        record = _read_pid_record(cfg, role)
        if record is None:
            process = f"no pid record in {cfg.log_dir} (PD_LOG_DIR)"
        else:
            process = f"pid {record['pid']} {'running' if _record_alive(record) else 'gone'}"
        healthy = _health_ok(cfg.health_url(role))
        all_ok &= healthy
        print(f"{role}: {process}, {'healthy' if healthy else 'not healthy'} ({cfg.health_url(role)})", file=out)
    return all_ok


# --------------------------------------------------------------------------------------------
# Foreground


def run_foreground(role: str, cfg: PDConfig) -> int:
    """Run ``role`` in the foreground (a container's main process): output to stdout and the log file.

    SIGTERM/SIGINT are forwarded to the role's process group, so `docker stop` ends every process it
    spawned; a group still alive PD_STOP_TIMEOUT seconds after the first of them is killed (SIGKILL).
    When the role's main process exits, whatever it left in its group is ended too.
    """
    argv = build_command(role, cfg)
    log_path = _new_log(cfg, role)
    with _open_private(log_path, LOG_FILE_MODE) as log_file:
        header = log_header(role, argv, role_env(role, cfg))
        log_file.write(header)
        sys.stdout.write(header)
        sys.stdout.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **role_env(role, cfg)},
        )
        stop_requested_at: list[float] = []  # set by the first forwarded signal

        def forward(signum, _frame):
            if not stop_requested_at:
                stop_requested_at.append(time.monotonic())
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)

        def tee():
            for chunk in iter(proc.stdout.readline, b""):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                log_file.write(chunk.decode(errors="replace"))
                log_file.flush()

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if stop_requested_at and time.monotonic() - stop_requested_at[0] >= cfg.stop_timeout:
                _log(f"{role}: still running {cfg.stop_timeout:.0f}s after the stop signal (PD_STOP_TIMEOUT); SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
                break
        if _live_group_members(proc.pid):
            _log(f"{role} exited ({code}); ending what it left in its process group")
            # The grace period runs from the stop signal, when there was one.
            elapsed = time.monotonic() - stop_requested_at[0] if stop_requested_at else 0.0
            _end_group(role, proc.pid, max(0.0, cfg.stop_timeout - elapsed))
        reader.join(timeout=10)
        # A role ended by a signal exits the way a shell reports it (128 + signal: SIGKILL -> 137).
        return code if code >= 0 else 128 - code
