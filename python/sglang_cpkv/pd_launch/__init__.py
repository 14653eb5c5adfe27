"""Build, validate, start and stop the P/D serving roles (prefill, decode, router) from environment variables.

``python -m sglang_cpkv.pd_launch dry-run|print|start|run|up|wait|status|stop [ROLE ...]``; the launchers in
``scripts/pd/`` and the image's entry point are thin wrappers, so the commands are built in one place. The default
is the documented GLM-5.1-FP8 deployment (a CP8 prefill node, a TP8 / attention-DP8 decode node, the router). The
``PD_*`` settings are declared in :mod:`sglang_cpkv.envs` (scope ``pd_launch``); what each command does, the
dry-run's checks, secrets and ports: ``docs/operations.md``, "Running on GPU hosts". Modules, by job:
:mod:`.config`, :mod:`.commands` (each role's argv and environment), :mod:`.redaction`, :mod:`.dry_run` and
:mod:`.startup_check` (the checks, run by ``PD_PYTHON``), :mod:`.lifecycle` (supervisor, pid records, health),
:mod:`.logs`, :mod:`.cli`. The launcher imports only the standard library.
"""

from sglang_cpkv.pd_launch.commands import build_command, role_env, router_args, server_args, shell_command
from sglang_cpkv.pd_launch.config import (
    ALL_CP_RANKS_TRANSFER_ENV,
    CP_SHARED_KV_FLAG,
    ENV_DEFAULTS,
    ROLES,
    PDConfig,
    PDLaunchError,
)
from sglang_cpkv.pd_launch.dry_run import dry_run

__all__ = [
    "ALL_CP_RANKS_TRANSFER_ENV",
    "CP_SHARED_KV_FLAG",
    "ENV_DEFAULTS",
    "ROLES",
    "PDConfig",
    "PDLaunchError",
    "build_command",
    "dry_run",
    "role_env",
    "router_args",
    "server_args",
    "shell_command",
]
