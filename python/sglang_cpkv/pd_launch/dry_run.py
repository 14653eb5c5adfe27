"""``dry-run``: print each role's command, then run its start-up checks with the interpreter that will serve it.

The checks (:mod:`.startup_check`) run in one ``PD_PYTHON`` process for all roles, each role with the
environment the launcher gives it: the same sglang, sglang_cpkv and variables the server will see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from sglang_cpkv.pd_launch.commands import build_command, role_env, router_args, server_args, shell_command
from sglang_cpkv.pd_launch.config import PDConfig, PDLaunchError, require_role
from sglang_cpkv.pd_launch.redaction import scrub, secret_values

STARTUP_CHECK_MODULE = "sglang_cpkv.pd_launch.startup_check"
STARTUP_CHECK_TIMEOUT_S = 600
# A checkout's development environment (`make setup`), named in the hint when it exists.
_CHECKOUT_VENV_PYTHON = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "python"


def _interpreter_hint() -> str:
    hint = (
        "PD_PYTHON must be the interpreter that serves: sglang with our patch queue applied, sglang_router "
        "and sglang_cpkv importable (in the image: python3)"
    )
    if _CHECKOUT_VENV_PYTHON.is_file():
        hint += f"; this checkout's environment: PD_PYTHON={_CHECKOUT_VENV_PYTHON}"
    else:
        hint += "; in a checkout, `make setup` builds one: PD_PYTHON=$PWD/.venv/bin/python"
    return hint


def _role_argv(role: str, cfg: PDConfig) -> list[str]:
    return router_args(cfg) if role == "router" else server_args(role, cfg)


def run_startup_checks(roles: Sequence[str], cfg: PDConfig, secrets: Sequence[str]) -> list[dict]:
    """One result per role from :mod:`.startup_check` under ``PD_PYTHON``; PDLaunchError when it cannot run."""
    request = {
        "roles": [{"role": r, "argv": _role_argv(r, cfg), "env": role_env(r, cfg)} for r in roles],
        "gpu_capability": cfg.gpu_capability,
    }
    try:
        proc = subprocess.run(
            [cfg.python, "-m", STARTUP_CHECK_MODULE],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=STARTUP_CHECK_TIMEOUT_S,
            env=dict(os.environ),
        )
    except FileNotFoundError:
        raise PDLaunchError(f"PD_PYTHON={cfg.python}: no such interpreter. {_interpreter_hint()}") from None
    except subprocess.TimeoutExpired:
        raise PDLaunchError(
            f"start-up checks under PD_PYTHON={cfg.python} took over {STARTUP_CHECK_TIMEOUT_S}s"
        ) from None
    try:
        results = json.loads(proc.stdout) if proc.returncode == 0 else None
    except ValueError:
        results = None
    if results is None:
        tail = "\n  ".join(proc.stderr.strip().splitlines()[-5:])
        raise PDLaunchError(
            f"PD_PYTHON={cfg.python} could not run the start-up checks (exit {proc.returncode}):\n  "
            f"{scrub(tail, secrets)}\n{_interpreter_hint()}"
        )
    return results


def dry_run(roles: Sequence[str], cfg: PDConfig, out=sys.stdout) -> None:
    """Print each role's command, then its start-up checks; raise PDLaunchError on the first refusal."""
    for role in roles:
        require_role(role)
    secrets = [value for role in roles for value in secret_values(build_command(role, cfg))]
    for role in roles:
        print(f"# {role}", file=out)
        print(shell_command(role, cfg), file=out)
    out.flush()
    for result in run_startup_checks(roles, cfg, secrets):
        role, status, message = result["role"], result["status"], scrub(result["message"], secrets)
        if status == "refused":
            raise PDLaunchError(f"{role}: {message}")
        if status == "unusable":
            raise PDLaunchError(f"{role}: PD_PYTHON={cfg.python} {message}. {_interpreter_hint()}")
        print(f"# {role}: {message}", file=out)
