"""The ``PD_*`` settings: defaults, parsing with errors that name the variable, and the checks across them."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from sglang_cpkv.envs import PD_LAUNCH, envs, parse_bool

ROLES = ("prefill", "decode", "router")
SERVER_ROLES = ("prefill", "decode")
CP_SHARED_KV_FLAG = "--enable-cp-shared-kv"
# Under CP shared-KV every prefill CP rank holds only the pages it owns, so every one of them must send:
# upstream reads this on the prefill (sglang_cpkv.hooks.server_args refuses the flag without it). The decode
# follows the mode the prefill publishes in its bootstrap info (sglang_cpkv.hooks.pd).
ALL_CP_RANKS_TRANSFER_ENV = envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.name
# The GPU the dry-run resolves for when the machine has none: the documented deployment's B300.
DEFAULT_GPU_CAPABILITY = "10.3"

# The launcher's variables with their defaults (PD_PYTHON's, this interpreter, is not a value), declared in
# sglang_cpkv.envs.
ENV_DEFAULTS: dict[str, str] = {
    name: field.default for name, field in envs.in_scope(PD_LAUNCH).items() if field.default is not None
}


class PDLaunchError(Exception):
    """A refusal meant for the user: the CLI prints it and exits non-zero."""


def _get(env: Mapping[str, str], name: str) -> str:
    return envs.field(name).get(env)


# `up` runs the three roles on one host: unless the operator sets them, the servers split one 8-GPU host (prefill TP4 /
# CP4 on GPUs 0-3, decode TP4 / attention DP4 after it), as docker/compose.pd.yaml's defaults do; ENV_DEFAULTS are
# those of one 8-GPU node per server.
ONE_HOST_DEFAULTS = {"PD_PREFILL_TP": "4", "PD_PREFILL_CP": "4", "PD_DECODE_TP": "4", "PD_DECODE_DP": "4"}


# What rotation can honour: every rotation renames each kept file, so a keep count past a hundred turns one log write
# into a long rename loop (the supervisor stops reading the server's output meanwhile); a log smaller than 64 KiB
# rotates on almost every write, and one past 1 TiB is never rotated on a real disk.
LOG_KEEP_BOUNDS = (1, 100)
LOG_MAX_BYTES_BOUNDS = (64 * 1024, 1024**4)


def _int(env: Mapping[str, str], name: str, minimum: int = 0, maximum: int | None = None) -> int:
    raw = _get(env, name)
    try:
        value = int(raw)
    except ValueError:
        raise PDLaunchError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise PDLaunchError(f"{name}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise PDLaunchError(f"{name}={value} must be <= {maximum}")
    return value


def _port(env: Mapping[str, str], name: str) -> int:
    port = _int(env, name, 1)
    if port > 65535:
        raise PDLaunchError(f"{name}={port} is not a TCP port (1-65535)")
    return port


def _size(env: Mapping[str, str], name: str) -> int:
    raw = _get(env, name).strip()
    match = re.fullmatch(r"(\d+)([KMG]?)", raw.upper())
    if not match or int(match.group(1)) == 0:
        raise PDLaunchError(f"{name}={raw!r} must be a positive size in bytes, with an optional K, M or G suffix")
    size = int(match.group(1)) * 1024 ** " KMG".index(match.group(2) or " ")
    low, high = LOG_MAX_BYTES_BOUNDS
    if not low <= size <= high:
        raise PDLaunchError(f"{name}={raw!r} must be between 64K and 1024G bytes")
    return size


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class ServerURL:
    """A URL the router reaches a server at, as the variable that set it (or its default) gave it."""

    variable: str
    url: str
    host: str
    port: int
    defaulted: bool

    def describe(self) -> str:
        return f"{self.variable}={self.url}" + (" (its default)" if self.defaulted else "")


def _server_url(env: Mapping[str, str], name: str, port: int) -> ServerURL:
    raw = _get(env, name).strip()
    url = raw or f"http://127.0.0.1:{port}"
    parts = urlsplit(url)
    try:
        url_port = parts.port
    except ValueError:
        url_port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or url_port == -1 or parts.path not in ("", "/"):
        raise PDLaunchError(f"{name}={raw!r} must be http(s)://HOST:PORT")
    if parts.hostname in ("0.0.0.0", "::"):
        raise PDLaunchError(f"{name}={raw!r}: {parts.hostname} is a listen address, not one the router can reach")
    if url_port is None:
        url_port = 443 if parts.scheme == "https" else 80
    return ServerURL(name, url.rstrip("/"), parts.hostname, url_port, defaulted=not raw)


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = _get(env, name)
    try:
        return parse_bool(name, raw)
    except ValueError:
        raise PDLaunchError(f"{name}={raw.strip().lower()!r} must be 0 or 1") from None


def _args(env: Mapping[str, str], name: str) -> list[str]:
    try:
        return shlex.split(_get(env, name))
    except ValueError as exc:
        raise PDLaunchError(f"{name}: cannot split into arguments ({exc})") from None


def _model_path(env: Mapping[str, str]) -> str:
    value = envs.PD_MODEL_PATH.text(env)
    if value is not None and not value.strip():
        # An empty value is a mistake (an unset variable in a compose file or an env file), not a request for
        # the default model: the default would be downloaded from the hub.
        raise PDLaunchError(
            "PD_MODEL_PATH is set but empty: set it to a local model directory or a Hugging Face model id "
            f"(left unset, it is {ENV_DEFAULTS['PD_MODEL_PATH']})"
        )
    return _get(env, "PD_MODEL_PATH")


def _log_dir(env: Mapping[str, str]) -> Path:
    raw = _get(env, "PD_LOG_DIR")
    if not raw:
        state_home = envs.XDG_STATE_HOME.get(env) or os.path.join(os.path.expanduser("~"), ".local", "state")
        return Path(state_home) / "sglang-cpkv" / "pd-logs"
    path = Path(raw).expanduser()
    if not path.is_absolute():
        raise PDLaunchError(
            f"PD_LOG_DIR={raw!r} must be an absolute path: `stop` and `status` find the pid records there "
            "from any directory"
        )
    return path


def _fraction(env: Mapping[str, str], name: str) -> float | None:
    """A ``--mem-fraction-static``: a number in (0, 1], or None for ``auto`` (upstream's heuristic)."""
    raw = _get(env, name).strip()
    if raw.lower() == "auto":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:  # also refuses nan
        raise PDLaunchError(
            f"{name}={raw!r} must be a fraction of the GPU's memory in (0, 1] (--mem-fraction-static), or auto "
            "(upstream's own default)"
        )
    return value


def _gpu_capability(env: Mapping[str, str]) -> str:
    raw = _get(env, "PD_GPU_CAPABILITY").strip()
    if raw and not re.fullmatch(r"\d+\.\d+", raw):
        raise PDLaunchError(f"PD_GPU_CAPABILITY={raw!r} must be MAJOR.MINOR, e.g. 9.0 (H100/H200) or 10.3 (B300)")
    return raw


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
    kv_cache_dtype: str
    prefill_host: str
    prefill_port: int
    prefill_tp: int
    prefill_cp: int
    prefill_dp: int
    cp_strategy: str
    prefill_base_gpu_id: int
    chunked_prefill_size: int
    prefill_mem_fraction_static: float | None  # None: upstream's own default
    cp_shared_kv: bool
    prefill_extra_args: tuple[str, ...]
    decode_host: str
    decode_port: int
    decode_tp: int
    decode_dp: int
    decode_base_gpu_id: int
    decode_cuda_graph_max_bs: int
    decode_mem_fraction_static: float | None
    decode_extra_args: tuple[str, ...]
    router_host: str
    router_port: int
    prefill_target: ServerURL
    decode_target: ServerURL
    router_extra_args: tuple[str, ...]
    log_dir: Path
    log_max_bytes: int
    log_keep: int
    health_timeout: float
    stop_timeout: float
    gpu_capability: str  # "" for this machine's GPU
    all_cp_ranks_transfer: str  # the environment's SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER, "" when unset

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PDConfig:
        env = os.environ if env is None else env
        prefill_port = _port(env, "PD_PREFILL_PORT")
        decode_port = _port(env, "PD_DECODE_PORT")
        cfg = cls(
            model_path=_model_path(env),
            python=envs.PD_PYTHON.get(env) or sys.executable,
            trust_remote_code=_flag(env, "PD_TRUST_REMOTE_CODE"),
            transfer_backend=_get(env, "PD_TRANSFER_BACKEND"),
            ib_device=_get(env, "PD_IB_DEVICE"),
            bootstrap_port=_port(env, "PD_BOOTSTRAP_PORT"),
            dsa_prefill_backend=_get(env, "PD_DSA_PREFILL_BACKEND"),
            dsa_decode_backend=_get(env, "PD_DSA_DECODE_BACKEND"),
            kv_cache_dtype=_get(env, "PD_KV_CACHE_DTYPE"),
            prefill_host=_get(env, "PD_PREFILL_HOST"),
            prefill_port=prefill_port,
            prefill_tp=_int(env, "PD_PREFILL_TP", 1),
            prefill_cp=_int(env, "PD_PREFILL_CP", 1),
            prefill_dp=_int(env, "PD_PREFILL_DP", 1),
            cp_strategy=_get(env, "PD_CP_STRATEGY"),
            prefill_base_gpu_id=_int(env, "PD_PREFILL_BASE_GPU_ID"),
            chunked_prefill_size=_int(env, "PD_CHUNKED_PREFILL_SIZE", 1),
            prefill_mem_fraction_static=_fraction(env, "PD_PREFILL_MEM_FRACTION_STATIC"),
            cp_shared_kv=_flag(env, "PD_CP_SHARED_KV"),
            prefill_extra_args=tuple(_args(env, "PD_PREFILL_EXTRA_ARGS")),
            decode_host=_get(env, "PD_DECODE_HOST"),
            decode_port=decode_port,
            decode_tp=_int(env, "PD_DECODE_TP", 1),
            decode_dp=_int(env, "PD_DECODE_DP", 1),
            decode_base_gpu_id=_int(env, "PD_DECODE_BASE_GPU_ID"),
            decode_cuda_graph_max_bs=_int(env, "PD_DECODE_CUDA_GRAPH_MAX_BS", 1),
            decode_mem_fraction_static=_fraction(env, "PD_DECODE_MEM_FRACTION_STATIC"),
            decode_extra_args=tuple(_args(env, "PD_DECODE_EXTRA_ARGS")),
            router_host=_get(env, "PD_ROUTER_HOST"),
            router_port=_port(env, "PD_ROUTER_PORT"),
            prefill_target=_server_url(env, "PD_PREFILL_URL", prefill_port),
            decode_target=_server_url(env, "PD_DECODE_URL", decode_port),
            router_extra_args=tuple(_args(env, "PD_ROUTER_EXTRA_ARGS")),
            log_dir=_log_dir(env),
            log_max_bytes=_size(env, "PD_LOG_MAX_BYTES"),
            log_keep=_int(env, "PD_LOG_KEEP", *LOG_KEEP_BOUNDS),
            health_timeout=float(_int(env, "PD_HEALTH_TIMEOUT", 1)),
            stop_timeout=float(_int(env, "PD_STOP_TIMEOUT", 1)),
            gpu_capability=_gpu_capability(env),
            all_cp_ranks_transfer=envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.text(env) or "",
        )
        cfg._check_layout()
        cfg._check_cp_shared_kv()
        cfg._check_topology()
        return cfg

    @property
    def prefill_url(self) -> str:
        return self.prefill_target.url

    @property
    def decode_url(self) -> str:
        return self.decode_target.url

    def _check_topology(self) -> None:
        """The router's view of the two servers and the ports: what cannot work on any set of nodes."""
        prefill, decode = self.prefill_target, self.decode_target
        if prefill.defaulted != decode.defaulted:
            given, missing = (decode, prefill) if prefill.defaulted else (prefill, decode)
            raise PDLaunchError(
                f"{given.variable} is set but {missing.variable} is not (it would default to {missing.url}): the "
                "router needs both servers' addresses, and hands the prefill URL's host to every decode request "
                "as the prefill's bootstrap address. Set both (on two nodes: addresses every node reaches)"
            )
        if is_loopback(prefill.host) != is_loopback(decode.host):
            local, remote = (prefill, decode) if is_loopback(prefill.host) else (decode, prefill)
            why = (
                "the router hands the prefill URL's host to every decode request as the prefill's bootstrap "
                "address, so a decode on another node would look for the prefill on its own host"
                if local is prefill
                else "a loopback URL means the host the router runs on, which is not the node of a remote prefill"
            )
            raise PDLaunchError(
                f"{local.describe()} is a loopback address but {remote.describe()} names another host: {why}. "
                "On two nodes set both PD_PREFILL_URL and PD_DECODE_URL to addresses every node reaches "
                "(on one host leave both loopback)"
            )
        for target, port_var, port in (
            (prefill, "PD_PREFILL_PORT", self.prefill_port),
            (decode, "PD_DECODE_PORT", self.decode_port),
        ):
            if is_loopback(target.host) and target.port != port:
                raise PDLaunchError(
                    f"{target.describe()} is this host, port {target.port}, but the server listens on {port_var}={port}"
                )
        one_host = prefill.host == decode.host or (is_loopback(prefill.host) and is_loopback(decode.host))
        ports = [("PD_PREFILL_PORT", self.prefill_port), ("PD_BOOTSTRAP_PORT", self.bootstrap_port)]
        ports += [("PD_DECODE_PORT", self.decode_port)] if one_host else []
        # The router runs on one of the nodes: its port must not clash with either server's.
        ports += [("PD_ROUTER_PORT", self.router_port)]
        for i, (name_a, port_a) in enumerate(ports):
            for name_b, port_b in ports[i + 1 :]:
                if port_a == port_b:
                    raise PDLaunchError(f"{name_a} and {name_b} are both {port_a}: each needs a port of its own")
        if not one_host and self.decode_port == self.router_port:
            raise PDLaunchError(
                f"PD_DECODE_PORT and PD_ROUTER_PORT are both {self.decode_port}: each needs a port of its own"
            )

    def gpu_ids(self, role: str) -> list[str]:
        """The GPUs ``role`` (prefill or decode) uses on its host, as the host names them.

        ``--base-gpu-id`` and ``--tp-size`` count within ``CUDA_VISIBLE_DEVICES`` when it is set.
        """
        base, count = {
            "prefill": (self.prefill_base_gpu_id, self.prefill_tp),
            "decode": (self.decode_base_gpu_id, self.decode_tp),
        }[role]
        visible = [d.strip() for d in (envs.CUDA_VISIBLE_DEVICES.get() or "").split(",") if d.strip()]
        ids = range(base, base + count)
        return [visible[i] if i < len(visible) else f"#{i}" for i in ids] if visible else [str(i) for i in ids]

    def role_port(self, role: str) -> int:
        return {"prefill": self.prefill_port, "decode": self.decode_port, "router": self.router_port}[role]

    def _check_cp_shared_kv(self) -> None:
        """What PD_CP_SHARED_KV=1 needs of the launcher's own settings (the server checks the rest at start-up)."""
        if not self.cp_shared_kv:
            return
        if self.prefill_cp <= 1:
            # Without CP the launcher passes no --enable-prefill-cp: a mode that shards the prefill's pages
            # over its CP ranks has nothing to shard over.
            raise PDLaunchError(
                f"PD_CP_SHARED_KV=1 needs PD_PREFILL_CP > 1 ({CP_SHARED_KV_FLAG} keeps each KV page on one "
                f"prefill CP rank), got PD_PREFILL_CP={self.prefill_cp}"
            )
        transfer = envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER
        try:
            sends = not self.all_cp_ranks_transfer or transfer.parse(transfer.name, self.all_cp_ranks_transfer)
        except ValueError:  # not a boolean to upstream, which then warns and reads its default (off)
            sends = False
        if not sends:
            raise PDLaunchError(
                f"PD_CP_SHARED_KV=1 needs {ALL_CP_RANKS_TRANSFER_ENV}=1 on the prefill (each CP rank sends the "
                f"pages it owns), but the environment sets it to {self.all_cp_ranks_transfer!r}"
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
        require_role(role)
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


def require_role(role: str) -> str:
    if role not in ROLES:
        raise PDLaunchError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    return role
