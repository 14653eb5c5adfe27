"""Build, validate, start and stop the P/D serving roles (prefill, decode, router) from environment variables.

The launchers in ``scripts/pd/`` and the Docker entry point are thin wrappers around this module, so the
commands are built in one place. The default is the documented GLM-5.1-FP8 deployment: one prefill node with
CP8 (``--tp-size 8 --attn-cp-size 8 --enable-prefill-cp --cp-strategy interleave``), one decode node
(``--tp-size 8 --attn-dp-size 8``) and the router in front of both.

    python -m sglang_cpkv.pd_launch dry-run [ROLE ...]   # print the commands; check them with upstream's parsers
    python -m sglang_cpkv.pd_launch print ROLE           # the command, shell-quoted
    python -m sglang_cpkv.pd_launch start ROLE           # background, log file, pid file, health wait
    python -m sglang_cpkv.pd_launch run ROLE             # foreground (container entry point), log tee'd
    python -m sglang_cpkv.pd_launch wait ROLE            # health wait only
    python -m sglang_cpkv.pd_launch status [ROLE ...]
    python -m sglang_cpkv.pd_launch stop [ROLE ...]      # ends only the process groups ``start`` recorded

``dry-run`` parses the server flags with upstream's own ``ServerArgs.add_cli_args`` parser (so a patched
upstream accepts our patch queue's flags) and the router flags with ``sglang_router``'s own parser, on CPU,
with no resolution: a misspelled flag fails here with upstream's argparse error, not on the cluster.
Abbreviated flags are refused too (``allow_abbrev=False``): a prefix that is unique today becomes ambiguous
when upstream adds a flag (0.5.23 split ``--cuda-graph-max-bs`` into ``-decode``/``-prefill``).

Environment (defaults in ``ENV_DEFAULTS``; every server gets both DSA backends so that prefill and decode
agree on the KV row layout):
  PD_MODEL_PATH, PD_PYTHON (interpreter that runs the roles), PD_TRUST_REMOTE_CODE (0/1),
  PD_TRANSFER_BACKEND, PD_IB_DEVICE, PD_BOOTSTRAP_PORT, PD_DSA_PREFILL_BACKEND, PD_DSA_DECODE_BACKEND,
  PD_PREFILL_HOST, PD_PREFILL_PORT, PD_PREFILL_TP, PD_PREFILL_CP, PD_PREFILL_DP, PD_CP_STRATEGY,
  PD_PREFILL_BASE_GPU_ID, PD_CHUNKED_PREFILL_SIZE, PD_CP_SHARED_KV (0/1: ``--enable-cp-shared-kv``, a flag
  of our patch queue, on the prefill server; set it on every node: it also gives prefill and decode
  ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1``), PD_PREFILL_EXTRA_ARGS,
  PD_DECODE_HOST, PD_DECODE_PORT, PD_DECODE_TP, PD_DECODE_DP, PD_DECODE_BASE_GPU_ID,
  PD_DECODE_CUDA_GRAPH_MAX_BS, PD_DECODE_EXTRA_ARGS,
  PD_ROUTER_HOST, PD_ROUTER_PORT, PD_PREFILL_URL, PD_DECODE_URL (how the router reaches the servers),
  PD_ROUTER_EXTRA_ARGS,
  PD_LOG_DIR (logs and pid files), PD_HEALTH_TIMEOUT, PD_STOP_TIMEOUT (seconds).
NCCL, InfiniBand and transfer-engine settings (``NCCL_*``, ``MC_*``, ``UCX_*``, ``SGLANG_*``) are passed
through from the environment unchanged and written into each log's header.

This module imports only the standard library; sglang and sglang_router are imported lazily by the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
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

ROLES = ("prefill", "decode", "router")
SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"
CP_SHARED_KV_FLAG = "--enable-cp-shared-kv"
# Under CP shared-KV every prefill CP rank holds only the pages it owns, so the decode side must pull from all
# CP ranks: upstream reads this on both servers (sglang_cpkv.hooks.server_args refuses the flag without it).
ALL_CP_RANKS_TRANSFER_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
# Environment variables worth recording in a log header: they change how NCCL, the KV transfer engine
# and upstream behave, and are the first thing to compare when two launches differ.
RECORDED_ENV_PREFIXES = ("PD_", "NCCL_", "MC_", "UCX_", "SGLANG_", "CUDA_", "NVSHMEM_", "GLOO_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")  # their values never reach a log

ENV_DEFAULTS: dict[str, str] = {
    "PD_MODEL_PATH": "zai-org/GLM-5.1-FP8",
    "PD_TRUST_REMOTE_CODE": "1",
    "PD_TRANSFER_BACKEND": "mooncake",
    "PD_IB_DEVICE": "",
    "PD_BOOTSTRAP_PORT": "8998",
    # flashmla_auto prefill with a flashmla_kv decode keeps both sides on the 656-byte FP8 row layout; leaving
    # one side unset on SM>=10 FP8 pairs it with trtllm (576-byte rows), which the other side cannot read.
    "PD_DSA_PREFILL_BACKEND": "flashmla_auto",
    "PD_DSA_DECODE_BACKEND": "flashmla_kv",
    "PD_PREFILL_HOST": "0.0.0.0",
    "PD_PREFILL_PORT": "30000",
    "PD_PREFILL_TP": "8",
    "PD_PREFILL_CP": "8",
    "PD_PREFILL_DP": "1",
    "PD_CP_STRATEGY": "interleave",
    "PD_PREFILL_BASE_GPU_ID": "0",
    "PD_CHUNKED_PREFILL_SIZE": "65536",
    "PD_CP_SHARED_KV": "0",
    "PD_PREFILL_EXTRA_ARGS": "",
    "PD_DECODE_HOST": "0.0.0.0",
    "PD_DECODE_PORT": "30001",
    "PD_DECODE_TP": "8",
    "PD_DECODE_DP": "8",
    "PD_DECODE_BASE_GPU_ID": "0",
    "PD_DECODE_CUDA_GRAPH_MAX_BS": "64",
    "PD_DECODE_EXTRA_ARGS": "",
    "PD_ROUTER_HOST": "0.0.0.0",
    "PD_ROUTER_PORT": "8000",
    "PD_PREFILL_URL": "",  # default: http://127.0.0.1:$PD_PREFILL_PORT
    "PD_DECODE_URL": "",  # default: http://127.0.0.1:$PD_DECODE_PORT
    "PD_ROUTER_EXTRA_ARGS": "",
    "PD_LOG_DIR": "pd-logs",
    "PD_HEALTH_TIMEOUT": "1800",
    "PD_STOP_TIMEOUT": "60",
}


class PDLaunchError(Exception):
    """A refusal meant for the user: the CLI prints it and exits non-zero."""


# --------------------------------------------------------------------------------------------
# Configuration


def _get(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    return ENV_DEFAULTS[name] if value is None or value == "" else value


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = _get(env, name)
    try:
        value = int(raw)
    except ValueError:
        raise PDLaunchError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise PDLaunchError(f"{name}={value} must be >= {minimum}")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = _get(env, name).strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise PDLaunchError(f"{name}={raw!r} must be 0 or 1")


def _args(env: Mapping[str, str], name: str) -> list[str]:
    try:
        return shlex.split(_get(env, name))
    except ValueError as exc:
        raise PDLaunchError(f"{name}: cannot split into arguments ({exc})") from None


@dataclasses.dataclass(frozen=True)
class PDConfig:
    model_path: str
    python: str
    trust_remote_code: bool
    transfer_backend: str
    ib_device: str
    bootstrap_port: int
    dsa_prefill_backend: str
    dsa_decode_backend: str
    prefill_host: str
    prefill_port: int
    prefill_tp: int
    prefill_cp: int
    prefill_dp: int
    cp_strategy: str
    prefill_base_gpu_id: int
    chunked_prefill_size: int
    cp_shared_kv: bool
    prefill_extra_args: tuple[str, ...]
    decode_host: str
    decode_port: int
    decode_tp: int
    decode_dp: int
    decode_base_gpu_id: int
    decode_cuda_graph_max_bs: int
    decode_extra_args: tuple[str, ...]
    router_host: str
    router_port: int
    prefill_url: str
    decode_url: str
    router_extra_args: tuple[str, ...]
    log_dir: Path
    health_timeout: float
    stop_timeout: float
    all_cp_ranks_transfer: str  # the environment's SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER, "" when unset

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PDConfig:
        env = os.environ if env is None else env
        prefill_port = _int(env, "PD_PREFILL_PORT", 1)
        decode_port = _int(env, "PD_DECODE_PORT", 1)
        cfg = cls(
            model_path=_get(env, "PD_MODEL_PATH"),
            python=env.get("PD_PYTHON") or sys.executable,
            trust_remote_code=_flag(env, "PD_TRUST_REMOTE_CODE"),
            transfer_backend=_get(env, "PD_TRANSFER_BACKEND"),
            ib_device=_get(env, "PD_IB_DEVICE"),
            bootstrap_port=_int(env, "PD_BOOTSTRAP_PORT", 1),
            dsa_prefill_backend=_get(env, "PD_DSA_PREFILL_BACKEND"),
            dsa_decode_backend=_get(env, "PD_DSA_DECODE_BACKEND"),
            prefill_host=_get(env, "PD_PREFILL_HOST"),
            prefill_port=prefill_port,
            prefill_tp=_int(env, "PD_PREFILL_TP", 1),
            prefill_cp=_int(env, "PD_PREFILL_CP", 1),
            prefill_dp=_int(env, "PD_PREFILL_DP", 1),
            cp_strategy=_get(env, "PD_CP_STRATEGY"),
            prefill_base_gpu_id=_int(env, "PD_PREFILL_BASE_GPU_ID"),
            chunked_prefill_size=_int(env, "PD_CHUNKED_PREFILL_SIZE", 1),
            cp_shared_kv=_flag(env, "PD_CP_SHARED_KV"),
            prefill_extra_args=tuple(_args(env, "PD_PREFILL_EXTRA_ARGS")),
            decode_host=_get(env, "PD_DECODE_HOST"),
            decode_port=decode_port,
            decode_tp=_int(env, "PD_DECODE_TP", 1),
            decode_dp=_int(env, "PD_DECODE_DP", 1),
            decode_base_gpu_id=_int(env, "PD_DECODE_BASE_GPU_ID"),
            decode_cuda_graph_max_bs=_int(env, "PD_DECODE_CUDA_GRAPH_MAX_BS", 1),
            decode_extra_args=tuple(_args(env, "PD_DECODE_EXTRA_ARGS")),
            router_host=_get(env, "PD_ROUTER_HOST"),
            router_port=_int(env, "PD_ROUTER_PORT", 1),
            prefill_url=_get(env, "PD_PREFILL_URL") or f"http://127.0.0.1:{prefill_port}",
            decode_url=_get(env, "PD_DECODE_URL") or f"http://127.0.0.1:{decode_port}",
            router_extra_args=tuple(_args(env, "PD_ROUTER_EXTRA_ARGS")),
            log_dir=Path(_get(env, "PD_LOG_DIR")).absolute(),
            health_timeout=float(_int(env, "PD_HEALTH_TIMEOUT", 1)),
            stop_timeout=float(_int(env, "PD_STOP_TIMEOUT", 1)),
            all_cp_ranks_transfer=env.get(ALL_CP_RANKS_TRANSFER_ENV, ""),
        )
        cfg._check_layout()
        cfg._check_cp_shared_kv()
        return cfg

    def _check_cp_shared_kv(self) -> None:
        if self.cp_shared_kv and self.all_cp_ranks_transfer not in ("", "1", "true", "True"):
            raise PDLaunchError(
                f"PD_CP_SHARED_KV=1 needs {ALL_CP_RANKS_TRANSFER_ENV}=1 on prefill and decode (each CP rank sends "
                f"the pages it owns), but the environment sets it to {self.all_cp_ranks_transfer!r}"
            )

    def _check_layout(self) -> None:
        """Divisibility rules of upstream's parallel layout (dp, cp, tp; tp fastest), named by env var."""
        if self.prefill_tp % (self.prefill_dp * self.prefill_cp):
            raise PDLaunchError(
                f"PD_PREFILL_TP={self.prefill_tp} must be divisible by PD_PREFILL_DP * PD_PREFILL_CP = "
                f"{self.prefill_dp} * {self.prefill_cp}"
            )
        if self.decode_tp % self.decode_dp:
            raise PDLaunchError(f"PD_DECODE_TP={self.decode_tp} must be divisible by PD_DECODE_DP={self.decode_dp}")

    def health_url(self, role: str) -> str:
        host, port = {
            "prefill": (self.prefill_host, self.prefill_port),
            "decode": (self.decode_host, self.decode_port),
            "router": (self.router_host, self.router_port),
        }[role]
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}/health"


def _require_role(role: str) -> str:
    if role not in ROLES:
        raise PDLaunchError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    return role


def _server_common(cfg: PDConfig, mode: str) -> list[str]:
    args = [
        "--model-path",
        cfg.model_path,
        "--disaggregation-mode",
        mode,
        "--disaggregation-transfer-backend",
        cfg.transfer_backend,
        "--disaggregation-bootstrap-port",
        str(cfg.bootstrap_port),
        "--dsa-prefill-backend",
        cfg.dsa_prefill_backend,
        "--dsa-decode-backend",
        cfg.dsa_decode_backend,
    ]
    if cfg.ib_device:
        args += ["--disaggregation-ib-device", cfg.ib_device]
    if cfg.trust_remote_code:
        args.append("--trust-remote-code")
    return args


def server_args(role: str, cfg: PDConfig) -> list[str]:
    """The arguments after ``python -m sglang.launch_server`` for ``role`` (prefill or decode)."""
    if role == "prefill":
        args = _server_common(cfg, "prefill") + [
            "--host",
            cfg.prefill_host,
            "--port",
            str(cfg.prefill_port),
            "--base-gpu-id",
            str(cfg.prefill_base_gpu_id),
            "--tp-size",
            str(cfg.prefill_tp),
            "--chunked-prefill-size",
            str(cfg.chunked_prefill_size),
        ]
        if cfg.prefill_dp > 1:
            args += ["--attn-dp-size", str(cfg.prefill_dp)]
        if cfg.prefill_cp > 1:
            args += ["--attn-cp-size", str(cfg.prefill_cp), "--enable-prefill-cp", "--cp-strategy", cfg.cp_strategy]
        if cfg.cp_shared_kv:
            args.append(CP_SHARED_KV_FLAG)
        return args + list(cfg.prefill_extra_args)
    if role == "decode":
        args = _server_common(cfg, "decode") + [
            "--host",
            cfg.decode_host,
            "--port",
            str(cfg.decode_port),
            "--base-gpu-id",
            str(cfg.decode_base_gpu_id),
            "--tp-size",
            str(cfg.decode_tp),
            "--cuda-graph-max-bs-decode",
            str(cfg.decode_cuda_graph_max_bs),
        ]
        if cfg.decode_dp > 1:
            args += ["--attn-dp-size", str(cfg.decode_dp)]
        return args + list(cfg.decode_extra_args)
    raise PDLaunchError(f"{role!r} is not a server role (prefill, decode)")


def router_args(cfg: PDConfig) -> list[str]:
    """The arguments after ``python -m sglang_router.launch_router``."""
    return [
        "--pd-disaggregation",
        "--prefill",
        cfg.prefill_url,
        str(cfg.bootstrap_port),
        "--decode",
        cfg.decode_url,
        "--host",
        cfg.router_host,
        "--port",
        str(cfg.router_port),
    ] + list(cfg.router_extra_args)


def role_env(role: str, cfg: PDConfig) -> dict[str, str]:
    """Environment variables the launcher adds for ``role`` (on top of the inherited environment)."""
    _require_role(role)
    if cfg.cp_shared_kv and role in ("prefill", "decode"):
        return {ALL_CP_RANKS_TRANSFER_ENV: "1"}
    return {}


def shell_command(role: str, cfg: PDConfig) -> str:
    """``role``'s command as one shell line, with the variables the launcher adds in front."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in role_env(role, cfg).items()]
    return " ".join([*assignments, shlex.join(build_command(role, cfg))])


def build_command(role: str, cfg: PDConfig) -> list[str]:
    """The full argv that starts ``role``."""
    _require_role(role)
    if role == "router":
        return [cfg.python, "-m", ROUTER_MODULE, *router_args(cfg)]
    return [cfg.python, "-m", SERVER_MODULE, *server_args(role, cfg)]


# --------------------------------------------------------------------------------------------
# Dry-run validation with upstream's own parsers


def _parse_with(parser: argparse.ArgumentParser, args: Sequence[str], what: str) -> argparse.Namespace:
    """Parse with ``parser``; turn its argparse error (usage + message on stderr, exit 2) into PDLaunchError."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parser.parse_args(list(args))
    except SystemExit:
        message = captured.getvalue().strip().splitlines()
        error = message[-1] if message else "argparse exited without a message"
        hint = ""
        if CP_SHARED_KV_FLAG in error:
            hint = f"\n  ({CP_SHARED_KV_FLAG} comes from our patch queue: run `python -m sglang_cpkv.overlay apply` on this sglang)"
        raise PDLaunchError(f"{what}: {error}{hint}") from None


def validate_server_args(role: str, args: Sequence[str]) -> None:
    """Parse ``args`` with upstream's ``ServerArgs`` CLI parser and build the (unresolved) record.

    No resolution runs (it needs the model config and a GPU); this catches unknown, misspelled,
    abbreviated and ill-typed flags and bad choices, with upstream's own error text.
    """
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    namespace = _parse_with(parser, args, f"{role} server flags rejected by upstream's parser")
    ServerArgs.from_cli_args(namespace)


def router_parser_available() -> bool:
    try:
        import sglang_router.router_args  # noqa: F401
    except ImportError:
        return False
    return True


def validate_router_args(args: Sequence[str]) -> None:
    """Parse ``args`` with sglang_router's own parser and build its ``RouterArgs`` (parses --prefill/--decode)."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="sglang_router.launch_router", allow_abbrev=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    namespace = _parse_with(parser, args, "router flags rejected by sglang_router's parser")
    router = RouterArgs.from_cli_args(namespace, use_router_prefix=False)
    if not (router.pd_disaggregation and router.prefill_urls and router.decode_urls):
        raise PDLaunchError(
            f"router: P/D mode needs --pd-disaggregation, --prefill and --decode (got {shlex.join(args)})"
        )


def dry_run(roles: Sequence[str], cfg: PDConfig, out=sys.stdout) -> None:
    """Print each role's command, then validate it; raise PDLaunchError on the first bad one."""
    for role in roles:
        _require_role(role)
        print(f"# {role}", file=out)
        print(shell_command(role, cfg), file=out)
    for role in roles:
        if role == "router":
            if router_parser_available():
                validate_router_args(router_args(cfg))
                print("# router: flags accepted by sglang_router's parser", file=out)
            else:
                print("# router: NOT validated (sglang_router is not installed here)", file=out)
        else:
            validate_server_args(role, server_args(role, cfg))
            print(f"# {role}: flags accepted by upstream's ServerArgs parser", file=out)


# --------------------------------------------------------------------------------------------
# Process lifecycle: start (background), run (foreground), wait, status, stop


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


def _proc_start_time(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return stat.start_time if stat else None


def _live_group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` that are not zombies (a container may have no init to reap them)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat and stat.pgrp == pgid and stat.state != "Z":
                members.append(int(entry.name))
    return members


def _pid_file(cfg: PDConfig, role: str) -> Path:
    return cfg.log_dir / f"{role}.pid"


def _log_header(role: str, argv: Sequence[str], added_env: Mapping[str, str]) -> str:
    env = {k: v for k, v in sorted({**os.environ, **added_env}.items()) if k.startswith(RECORDED_ENV_PREFIXES)}
    lines = [
        f"# pd_launch {role} at {time.strftime('%Y-%m-%d %H:%M:%S %Z')} on {os.uname().nodename}",
        f"# command: {shlex.join(argv)}",
    ]
    lines += [f"# env {k}={'<redacted>' if any(word in k for word in SECRET_WORDS) else v}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _new_log(cfg: PDConfig, role: str) -> Path:
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
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


def start(role: str, cfg: PDConfig, wait: bool = True) -> int:
    """Start ``role`` in its own process group, logging to PD_LOG_DIR; record its pid; wait for health."""
    _require_role(role)
    existing = _read_pid_record(cfg, role)
    if existing and _record_alive(existing):
        raise PDLaunchError(f"{role} already runs (pid {existing['pid']}, {_pid_file(cfg, role)}); stop it first")
    argv = build_command(role, cfg)
    log_path = _new_log(cfg, role)
    with open(log_path, "w") as log_file:
        log_file.write(_log_header(role, argv, role_env(role, cfg)))
        log_file.flush()
        # start_new_session: the role and every process it spawns (schedulers, detokenizer) share one
        # process group that `stop` can end without touching anything else on the host.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **role_env(role, cfg)},
        )
    record = {
        "role": role,
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_time": _proc_start_time(proc.pid),
        "argv": argv,
        "log": str(log_path),
    }
    _pid_file(cfg, role).write_text(json.dumps(record, indent=1) + "\n")
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
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
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
        _require_role(role)
        record = _read_pid_record(cfg, role)
        if record is None:
            _log(f"{role}: no pid record in {cfg.log_dir}; nothing to stop")
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
            process = "no pid record (not started by `start` from this PD_LOG_DIR)"
        else:
            process = f"pid {record['pid']} {'running' if _record_alive(record) else 'gone'}"
        healthy = _health_ok(cfg.health_url(role))
        all_ok &= healthy
        print(f"{role}: {process}, {'healthy' if healthy else 'not healthy'} ({cfg.health_url(role)})", file=out)
    return all_ok


def run_foreground(role: str, cfg: PDConfig) -> int:
    """Run ``role`` in the foreground (a container's main process): output to stdout and the log file.

    SIGTERM/SIGINT are forwarded to the role's process group, so `docker stop` ends every process it
    spawned; when the role's main process exits, whatever it left in its group is ended too.
    """
    argv = build_command(role, cfg)
    log_path = _new_log(cfg, role)
    with open(log_path, "w") as log_file:
        header = _log_header(role, argv, role_env(role, cfg))
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

        def forward(signum, _frame):
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
        code = proc.wait()
        if _live_group_members(proc.pid):
            _log(f"{role} exited ({code}); ending what it left in its process group")
            _end_group(role, proc.pid, cfg.stop_timeout)
        reader.join(timeout=10)
        return code


# --------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_cpkv.pd_launch", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dry-run", help="print the commands and validate their flags with upstream's parsers (CPU)")
    p.add_argument("roles", nargs="*", default=list(ROLES))
    p = sub.add_parser("print", help="print one role's command, shell-quoted")
    p.add_argument("role")
    p = sub.add_parser("start", help="start a role in the background and wait until it is healthy")
    p.add_argument("role")
    p.add_argument("--no-wait", action="store_true", help="return once started, without the health wait")
    p = sub.add_parser("run", help="run a role in the foreground (container entry point)")
    p.add_argument("role")
    p = sub.add_parser("wait", help="wait until a role answers /health")
    p.add_argument("role")
    p = sub.add_parser("status", help="recorded pid and health of each role")
    p.add_argument("roles", nargs="*", default=list(ROLES))
    p = sub.add_parser("stop", help="stop the roles this tool started (router first)")
    p.add_argument("roles", nargs="*", default=list(reversed(ROLES)))
    args = parser.parse_args(argv)
    try:
        cfg = PDConfig.from_env()
        if args.command == "dry-run":
            dry_run(args.roles, cfg)
        elif args.command == "print":
            print(shell_command(args.role, cfg))
        elif args.command == "start":
            start(args.role, cfg, wait=not args.no_wait)
        elif args.command == "run":
            return run_foreground(_require_role(args.role), cfg)
        elif args.command == "wait":
            wait_healthy(_require_role(args.role), cfg)
        elif args.command == "status":
            return 0 if status(args.roles, cfg) else 1
        elif args.command == "stop":
            stop(args.roles, cfg)
    except PDLaunchError as exc:
        print(f"pd_launch: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
