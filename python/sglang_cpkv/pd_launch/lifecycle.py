"""Process lifecycle of the roles: run (foreground), start (background), wait, status, stop, up (one host).

Every role runs under a supervisor, this package's ``run`` (the container's main process, or detached by ``start``):
it starts the role in a process group of its own, records it in ``PD_LOG_DIR/<role>.pid`` (0600, secrets redacted),
scrubs every known secret out of the role's output into its log (:mod:`.logs`) and, in the foreground, stdout;
SIGTERM, SIGINT and SIGHUP end the group (SIGTERM, then SIGKILL after ``PD_STOP_TIMEOUT``), as ``stop`` does from
any shell. A role is healthy when its recorded group is alive, holds the role's port and answers ``/health`` 200
(the router: both servers too). Called by :mod:`.cli`; operations: ``docs/operations.md``, "Running on GPU hosts".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from sglang_cpkv.envs import envs
from sglang_cpkv.pd_launch.commands import build_command, role_env
from sglang_cpkv.pd_launch.config import ROLES, PDConfig, PDLaunchError, is_loopback, require_role
from sglang_cpkv.pd_launch.logs import LOG_FILE_MODE, LogSink, ensure_log_dir, new_log, open_private, tail
from sglang_cpkv.pd_launch.redaction import StreamScrubber, redact_argv, redact_env_value, scrub, secret_values

# Environment variables worth recording in a log header: they change how NCCL, the KV transfer engine
# and upstream behave, and are the first thing to compare when two launches differ.
RECORDED_ENV_PREFIXES = ("PD_", "NCCL_", "MC_", "UCX_", "SGLANG_", "CUDA_", "NVSHMEM_", "GLOO_")
PID_FILE_MODE = 0o600
KILL_WAIT_S = 10.0  # after SIGKILL: how long the kernel may take to reap the group
SUPERVISOR_EXIT_WAIT_S = 10.0  # after its role's group ended: how long the supervisor may take to drain and exit
HEALTH_REQUEST_TIMEOUT_S = 5.0
RECORD_WAIT_S = 60.0  # `start --no-wait`: how long the supervisor may take to start the role and record it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


def _boot_id() -> str:
    """This boot of the machine: a record written in another boot names processes that are gone (their pids and
    group ids may be another program's now)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """This process's pid namespace: a record written in another one (a container) names other processes."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _alive(pid: int, start_time: int | None) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat.state != "Z" and stat.start_time == start_time


# --------------------------------------------------------------------------------------------
# Pid records


def _pid_file(cfg: PDConfig, role: str) -> Path:
    return cfg.log_dir / f"{role}.pid"


def log_header(role: str, argv: Sequence[str], added_env: Mapping[str, str]) -> str:
    env = {k: v for k, v in sorted({**os.environ, **added_env}.items()) if k.startswith(RECORDED_ENV_PREFIXES)}
    lines = [
        f"# pd_launch {role} at {time.strftime('%Y-%m-%d %H:%M:%S %Z')} on {os.uname().nodename}",
        f"# command: {shlex.join(redact_argv(argv))}",
    ]
    lines += [f"# env {k}={redact_env_value(k, v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _read_pid_record(cfg: PDConfig, role: str) -> dict | None:
    path = _pid_file(cfg, role)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise PDLaunchError(f"{path} is not a pid record written by pd_launch; inspect and remove it") from None


def _write_pid_record(cfg: PDConfig, role: str, record: dict) -> None:
    """Written whole (a temporary file renamed over the record): readers never see half a record."""
    path = _pid_file(cfg, role)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    with os.fdopen(open_private(temporary, PID_FILE_MODE), "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
    os.replace(temporary, path)


def _foreign(record: dict) -> bool:
    """Written in another pid namespace (another container, or the host for a container): not ours to judge."""
    namespace = record.get("pidns")  # absent in records of an older launcher: written here
    return namespace is not None and namespace != _pid_namespace()


def _record_alive(record: dict) -> bool:
    """True while the process group the record names still has live members that are ours.

    A record of another boot (a reboot) or another pid namespace (a container restart) names nobody's processes
    here: its pids and group ids may be other programs' now. Within this boot, a pid can be recycled only once
    its process group is empty, so a leader pid that now belongs to a process with another start time means our
    group is gone (and that group id is someone else's); with the leader gone and the group alive (the router's
    launcher leaves the router in its group), the members are ours.
    """
    if _foreign(record):
        return False
    if record.get("boot_id", _boot_id()) != _boot_id():  # written before a reboot: nothing it names is ours
        return False
    leader = _proc_stat(record["pid"])
    if leader is not None and leader.start_time != record["start_time"]:
        return False
    return bool(_live_group_members(record["pgid"]))


def _describe_gpus(ids: Sequence[str]) -> str:
    return "GPU " + ",".join(ids) if ids else "no GPU"


def preflight(role: str, cfg: PDConfig) -> None:
    """What must hold on this host before ``role`` starts: not already running, its ports free, its GPUs unused."""
    require_role(role)
    ensure_log_dir(cfg)
    record = _read_pid_record(cfg, role)
    if record and _record_alive(record):
        raise PDLaunchError(f"{role} already runs (pid {record['pid']}, {_pid_file(cfg, role)}); stop it first")
    host = {"prefill": cfg.prefill_host, "decode": cfg.decode_host, "router": cfg.router_host}[role]
    ports = [(f"PD_{role.upper()}_PORT", cfg.role_port(role))]
    if role == "prefill":
        ports.append(("PD_BOOTSTRAP_PORT", cfg.bootstrap_port))
    for variable, port in ports:
        _check_port_free(variable, host, port)
    if role in ("prefill", "decode"):
        check_host_has_gpus(cfg, [role])
        other = "decode" if role == "prefill" else "prefill"
        theirs = _read_pid_record(cfg, other)
        mine = cfg.gpu_ids(role)
        if theirs and _record_alive(theirs) and set(mine) & set(theirs.get("gpus", [])):
            raise PDLaunchError(
                f"PD_{role.upper()}_BASE_GPU_ID={getattr(cfg, role + '_base_gpu_id')} and "
                f"PD_{role.upper()}_TP={getattr(cfg, role + '_tp')} put the {role} on {_describe_gpus(mine)}, "
                f"but the {other} already runs on {_describe_gpus(theirs['gpus'])} of this host"
            )


def _check_port_free(variable: str, host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is not a user
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PDLaunchError(
                f"{variable}={port}: cannot listen on {host}:{port} ({exc.strerror}); another process uses it"
            ) from None


NVIDIA_SMI_TIMEOUT_S = 30.0


def host_gpus() -> tuple[int, str] | None:
    """(how many GPUs the servers of this host can use, where that was read), or None when it cannot be known here.

    As the servers count them: ``--base-gpu-id`` and ``--tp-size`` index ``CUDA_VISIBLE_DEVICES`` when it is set,
    else every GPU of the host (``nvidia-smi -L``, the driver's list; a container sees the GPUs it was given).
    """
    visible = envs.CUDA_VISIBLE_DEVICES.get() or ""
    if visible.strip():
        return len([d for d in visible.split(",") if d.strip()]), f"CUDA_VISIBLE_DEVICES={visible}"
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):  # no NVIDIA driver here (a CPU machine), or a hung one
        return None
    if listed.returncode != 0:
        return None
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU ")), "nvidia-smi -L"


def _gpu_range(first: int, count: int) -> str:
    return f"GPU {first}" if count == 1 else f"GPU {first}-{first + count - 1}"


def check_host_has_gpus(cfg: PDConfig, roles: Sequence[str]) -> None:
    """Each server role's GPUs (``PD_<ROLE>_BASE_GPU_ID`` + ``PD_<ROLE>_TP``) are GPUs this host has; unchecked
    where the count cannot be known (:func:`host_gpus`)."""
    host = host_gpus()
    if host is None:
        return
    count, source = host
    for role in roles:
        base, tp = getattr(cfg, f"{role}_base_gpu_id"), getattr(cfg, f"{role}_tp")
        if base + tp > count:
            has = _gpu_range(0, count).replace("GPU ", "") if count else "none"
            raise PDLaunchError(
                f"PD_{role.upper()}_BASE_GPU_ID={base} and PD_{role.upper()}_TP={tp} put the {role} on "
                f"{_gpu_range(base, tp)}, but this host has {count} GPUs ({has}, {source}): lower them, or run the "
                "prefill and the decode on nodes of their own (on one host `up` places the decode after the prefill, "
                "PD_PREFILL_BASE_GPU_ID + PD_PREFILL_TP, unless PD_DECODE_BASE_GPU_ID is set)"
            )


def check_one_host(cfg: PDConfig) -> None:
    """``up``: all three roles on this host, so the servers' URLs are loopback, their GPUs disjoint and present."""
    for target in (cfg.prefill_target, cfg.decode_target):
        if not is_loopback(target.host):
            raise PDLaunchError(f"up starts every role on this host, but {target.describe()} names another host")
    shared = set(cfg.gpu_ids("prefill")) & set(cfg.gpu_ids("decode"))
    if shared:
        raise PDLaunchError(
            f"on one host the prefill (PD_PREFILL_BASE_GPU_ID={cfg.prefill_base_gpu_id}, "
            f"PD_PREFILL_TP={cfg.prefill_tp}: {_describe_gpus(cfg.gpu_ids('prefill'))}) and the decode "
            f"(PD_DECODE_BASE_GPU_ID={cfg.decode_base_gpu_id}, PD_DECODE_TP={cfg.decode_tp}: "
            f"{_describe_gpus(cfg.gpu_ids('decode'))}) share {_describe_gpus(sorted(shared))}"
        )
    check_host_has_gpus(cfg, ["prefill", "decode"])


# --------------------------------------------------------------------------------------------
# Health


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_REQUEST_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on ``port`` (IPv4 and IPv6), or None when /proc/net cannot say."""
    inodes, readable = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes if readable else None


def _group_listens(pgid: int, port: int) -> bool:
    """Whether a process of group ``pgid`` holds a socket listening on ``port``."""
    inodes = _listening_inodes(port)
    if inodes is None:  # no /proc/net here: the liveness and /health checks must do
        return True
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in _live_group_members(pgid):
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in wanted:
                        return True
    return False


def check_health(role: str, cfg: PDConfig, record: dict | None) -> tuple[bool, str]:
    """(healthy, what was seen): our recorded group alive, listening on the role's port, /health 200."""
    if record is None:
        return False, f"no pid record in {cfg.log_dir} (PD_LOG_DIR)"
    if _foreign(record):
        return False, f"pid {record['pid']} recorded in another pid namespace (a container): check it there"
    if not _record_alive(record):
        return False, f"pid {record['pid']} gone"
    port = cfg.role_port(role)
    if not _group_listens(record["pgid"], port):
        held = "another process listens there" if _listening_inodes(port) else "nothing listens there yet"
        return False, f"pid {record['pid']} running, not listening on port {port} ({held})"
    if not _health_ok(cfg.health_url(role)):
        return False, f"pid {record['pid']} running, {cfg.health_url(role)} does not answer 200"
    if role == "router":
        for target in (cfg.prefill_target, cfg.decode_target):
            if not _health_ok(target.url + "/health"):
                return False, f"pid {record['pid']} running, but its worker {target.url}/health does not answer 200"
    return True, f"pid {record['pid']} running, healthy"


# A wait says what it sees whenever that changes, and at least this often (a router started before its workers
# waits for them; the default PD_HEALTH_TIMEOUT is half an hour).
PROGRESS_EVERY_S = 30.0


def wait_healthy(role: str, cfg: PDConfig, supervisor: subprocess.Popen | None = None) -> None:
    """Poll until ``role`` is healthy (``check_health``), its supervisor exits, or PD_HEALTH_TIMEOUT passes; the
    progress goes to stderr (:data:`PROGRESS_EVERY_S`)."""
    require_role(role)
    started = time.monotonic()
    deadline = started + cfg.health_timeout
    _log(f"waiting for {role} at {cfg.health_url(role)} (up to {cfg.health_timeout:.0f}s)")
    seen, shown, next_progress = "", "", started + PROGRESS_EVERY_S
    while True:
        if supervisor is not None and supervisor.poll() is not None:
            raise PDLaunchError(f"{role} exited before it became healthy (see {cfg.log_dir / (role + '.log')})")
        record = _read_pid_record(cfg, role)
        if supervisor is not None and record is not None and record.get("supervisor") != supervisor.pid:
            record = None  # an older launch's record: ours is not written yet
        healthy, seen = check_health(role, cfg, record)
        if healthy:
            _log(f"{role} is healthy")
            return
        now = time.monotonic()
        if now >= deadline:
            raise PDLaunchError(f"{role} not healthy after {cfg.health_timeout:.0f}s (PD_HEALTH_TIMEOUT): {seen}")
        if (seen != shown and record is not None) or now >= next_progress:
            _log(f"still waiting for {role} ({now - started:.0f}s of {cfg.health_timeout:.0f}s): {seen}")
            shown, next_progress = seen, now + PROGRESS_EVERY_S
        interval = 0.5 if time.monotonic() - started < 10 else 2.0  # quick for a quick start, then gentle
        time.sleep(min(interval, max(0.1, deadline - time.monotonic())))


# --------------------------------------------------------------------------------------------
# Ending process groups


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


def _end_supervisor(role: str, pid: int, start_time: int | None) -> None:
    """Let the supervisor drain and exit once its role is gone; end it if it does not."""
    for sig, grace in ((None, SUPERVISOR_EXIT_WAIT_S), (signal.SIGTERM, KILL_WAIT_S), (signal.SIGKILL, KILL_WAIT_S)):
        if sig is not None and _alive(pid, start_time):
            _log(f"{role}: supervisor {pid} still running; {sig.name}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _alive(pid, start_time) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _alive(pid, start_time):
            return


def stop(roles: Sequence[str], cfg: PDConfig) -> None:
    """End the process groups the records name: SIGTERM, then SIGKILL after PD_STOP_TIMEOUT."""
    for role in roles:
        require_role(role)
    for role in roles:
        record = _read_pid_record(cfg, role)
        if record is None:
            _log(f"{role}: no pid record in {cfg.log_dir} (PD_LOG_DIR); nothing to stop")
            continue
        if _foreign(record):
            _log(f"{role}: pid {record['pid']} was recorded in another pid namespace (a container); stop it there")
            continue
        if _record_alive(record):
            _end_group(role, record["pgid"], cfg.stop_timeout)
            _log(f"{role}: stopped (process group {record['pgid']})")
        else:
            _log(f"{role}: pid {record['pid']} already gone")
        if record.get("supervisor"):
            _end_supervisor(role, record["supervisor"], record.get("supervisor_start_time"))
        current = _read_pid_record(cfg, role)
        if current is not None and current.get("pid") == record["pid"]:
            _pid_file(cfg, role).unlink(missing_ok=True)


def status(roles: Sequence[str], cfg: PDConfig, out=sys.stdout) -> bool:
    """Print each role's recorded process and health; True when all of them are healthy."""
    for role in roles:
        require_role(role)
    all_ok = True
    for role in roles:
        healthy, seen = check_health(role, cfg, _read_pid_record(cfg, role))
        all_ok &= healthy
        print(f"{role}: {seen}{'' if healthy else ', not healthy'} ({cfg.health_url(role)})", file=out)
    return all_ok


# --------------------------------------------------------------------------------------------
# The supervisor (foreground `run`, and what `start` launches)


def run_role(role: str, cfg: PDConfig, echo: bool = True, log_path: Path | None = None) -> int:
    """Run ``role`` under this process until it exits; return its exit status (128 + signal when killed).

    ``echo``: copy its output to stdout (the foreground). ``log_path``: a log ``start`` created (else a new one).
    """
    preflight(role, cfg)
    argv = build_command(role, cfg)
    added_env = role_env(role, cfg)
    env = {**os.environ, **added_env}
    scrubber = StreamScrubber(secret_values(argv, env))
    log_path = log_path or new_log(cfg, role)
    sink = LogSink(log_path, cfg.log_max_bytes, cfg.log_keep, echo=echo)
    sink.write(log_header(role, argv, added_env).encode())
    stop_requested_at: list[float] = []  # set by the first stop signal

    def request_stop(signum, _frame):
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())

    for sig in STOP_SIGNALS:  # a signal before the role exists: it is not started
        signal.signal(sig, request_stop)
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # The role and every process it spawns share one process group that `stop` can end without touching
        # anything else on the host; in a session of its own, a closing terminal does not signal it directly.
        start_new_session=True,
        env=env,
    )
    me, leader = _proc_stat(os.getpid()), _proc_stat(proc.pid)
    record = {
        "role": role,
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_time": leader.start_time if leader else None,
        "supervisor": os.getpid(),
        "supervisor_start_time": me.start_time if me else None,
        "pidns": _pid_namespace(),
        "boot_id": _boot_id(),
        "gpus": cfg.gpu_ids(role) if role != "router" else [],
        "argv": redact_argv(argv),
        "log": str(log_path),
    }
    _write_pid_record(cfg, role, record)
    sink.note(f"started {role}: pid {proc.pid}, log {log_path}")

    def forward(signum, _frame):
        request_stop(signum, _frame)
        # SIGHUP (the terminal went away) ends the role like SIGTERM: nothing would be left to watch it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    if stop_requested_at:
        forward(signal.SIGTERM, None)

    def drain():
        # Reads until the role's group closes the pipe, whatever happens to the log or stdout: a server whose
        # output nobody reads blocks.
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            sink.write(scrubber.feed(chunk))
        sink.write(scrubber.flush())

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    while True:
        try:
            code = proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if stop_requested_at and time.monotonic() - stop_requested_at[0] >= cfg.stop_timeout:
            sink.note(f"{role}: still running {cfg.stop_timeout:.0f}s after the stop signal (PD_STOP_TIMEOUT); SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
            break
    if _live_group_members(proc.pid):
        sink.note(f"{role} exited ({code}); ending what it left in its process group")
        # The grace period runs from the stop signal, when there was one.
        elapsed = time.monotonic() - stop_requested_at[0] if stop_requested_at else 0.0
        _end_group(role, proc.pid, max(0.0, cfg.stop_timeout - elapsed))
    reader.join(timeout=10)
    current = _read_pid_record(cfg, role)
    if current is not None and current.get("pid") == proc.pid:
        _pid_file(cfg, role).unlink(missing_ok=True)
    # A role ended by a signal exits the way a shell reports it (128 + signal: SIGKILL -> 137).
    status_code = code if code >= 0 else 128 - code
    sink.note(f"{role} exited with status {status_code}")
    sink.close()
    return status_code


class Interrupted(PDLaunchError):
    """Ctrl-C while a role started: what had started is stopped (exit status 130)."""


def start(role: str, cfg: PDConfig, wait: bool = True) -> None:
    """Start ``role``'s supervisor detached (its log in PD_LOG_DIR); wait until the role is healthy."""
    preflight(role, cfg)
    log_path = new_log(cfg, role)
    # The supervisor's own errors (a traceback) land in the log too.
    with os.fdopen(open_private(log_path, LOG_FILE_MODE, os.O_APPEND), "w") as errors:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "sglang_cpkv.pd_launch", "run", "--detached", "--log", str(log_path), role],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,  # outlives this shell: no SIGHUP from its terminal
        )
    _log(f"started {role}: supervisor pid {supervisor.pid}, log {log_path}")
    if not wait:
        # Return once the role is recorded, so that a `stop` right after finds it.
        deadline = time.monotonic() + RECORD_WAIT_S
        while supervisor.poll() is None and time.monotonic() < deadline:
            record = _read_pid_record(cfg, role)
            if record is not None and record.get("supervisor") == supervisor.pid:
                return
            time.sleep(0.1)
        if supervisor.poll() is not None:
            raise PDLaunchError(f"{role} exited at once (see {log_path})")
        return
    try:
        wait_healthy(role, cfg, supervisor)
    except (PDLaunchError, KeyboardInterrupt) as failure:
        interrupted = isinstance(failure, KeyboardInterrupt)
        if interrupted:  # Ctrl-C: stop what this start began; a second Ctrl-C must not cut that short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _log(f"interrupted: stopping {role}")
        else:
            argv = build_command(role, cfg)
            _log(f"last lines of {log_path}:\n{scrub(tail(log_path), secret_values(argv, dict(os.environ)))}")
        record = _read_pid_record(cfg, role)
        if record is not None and record.get("supervisor") == supervisor.pid:
            stop([role], cfg)
        elif supervisor.poll() is None:  # the role is not recorded yet: the supervisor ends whatever it started
            supervisor.terminate()
            try:
                supervisor.wait(cfg.stop_timeout + KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                supervisor.kill()
        if interrupted:
            raise Interrupted(f"interrupted while {role} was starting; {role} stopped") from None
        raise


def up(cfg: PDConfig) -> None:
    """All three roles on this host, each after the previous one is healthy.

    Every role's start-up conditions (not running already, its ports free, its GPUs present and unused) are checked
    before the first one starts: a refusal starts and stops nothing. On a failure later, the roles this ``up``
    started are stopped again, and only those.
    """
    check_one_host(cfg)
    for role in ROLES:
        preflight(role, cfg)
    started: list[str] = []
    for role in ROLES:
        try:
            start(role, cfg)  # on its own failure it stops what it started of its role
        except (PDLaunchError, KeyboardInterrupt) as failure:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the roles already up are stopped whatever comes next
            stop(list(reversed(started)), cfg)
            said = f"{', '.join(started)} stopped again" if started else "no other role was started"
            if isinstance(failure, KeyboardInterrupt):
                raise Interrupted(f"interrupted while {role} was starting; {role} and {said}") from None
            if isinstance(failure, Interrupted):
                raise Interrupted(f"{failure}; {said}") from None
            raise
        started.append(role)
    status(ROLES, cfg)
