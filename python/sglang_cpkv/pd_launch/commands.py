"""Each role's command line and the environment variables the launcher adds for it."""

from __future__ import annotations

import shlex

from sglang_cpkv.pd_launch.config import (
    ALL_CP_RANKS_TRANSFER_ENV,
    CP_SHARED_KV_FLAG,
    PDConfig,
    PDLaunchError,
    require_role,
)
from sglang_cpkv.pd_launch.redaction import redact_argv

SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"


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
        "--kv-cache-dtype",
        cfg.kv_cache_dtype,
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
        if cfg.prefill_mem_fraction_static is not None:
            args += ["--mem-fraction-static", f"{cfg.prefill_mem_fraction_static:g}"]
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
        if cfg.decode_mem_fraction_static is not None:
            args += ["--mem-fraction-static", f"{cfg.decode_mem_fraction_static:g}"]
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
    require_role(role)
    if cfg.cp_shared_kv and role == "prefill":
        return {ALL_CP_RANKS_TRANSFER_ENV: "1"}
    return {}


def build_command(role: str, cfg: PDConfig) -> list[str]:
    """The full argv that starts ``role``."""
    require_role(role)
    if role == "router":
        return [cfg.python, "-m", ROUTER_MODULE, *router_args(cfg)]
    return [cfg.python, "-m", SERVER_MODULE, *server_args(role, cfg)]


def shell_command(role: str, cfg: PDConfig) -> str:
    """``role``'s command as one shell line, the variables the launcher adds in front, secret values redacted."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in role_env(role, cfg).items()]
    return " ".join([*assignments, shlex.join(redact_argv(build_command(role, cfg)))])
