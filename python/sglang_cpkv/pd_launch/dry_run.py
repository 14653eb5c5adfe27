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


IB_SYSFS = Path("/sys/class/infiniband")
IB_FLAG = "--disaggregation-ib-device"


def missing_ib_devices(cfg: PDConfig, sysfs: Path | None = None) -> list[str]:
    """The devices of PD_IB_DEVICE when this machine has none of them: it is not the machine the role runs on, and
    upstream's start-up check of them in sysfs is left to that one. Empty when it has any (a host missing only some
    of them is the role's host misconfigured: upstream's check runs and refuses)."""
    sysfs = IB_SYSFS if sysfs is None else sysfs
    devices = [d.strip() for d in cfg.ib_device.split(",") if d.strip()]
    return devices if not any((sysfs / d).exists() for d in devices) else []


def _role_argv(role: str, cfg: PDConfig) -> list[str]:
    """The role's arguments as the start-up checks resolve them here: the machine-specific InfiniBand devices are
    left to the machine the role runs on when this one lacks them (:func:`dry_run` says so)."""
    if role == "router":
        return router_args(cfg)
    argv = server_args(role, cfg)
    if missing_ib_devices(cfg) and IB_FLAG in argv:
        at = argv.index(IB_FLAG)
        argv = argv[:at] + argv[at + 2 :]
    return argv


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
    missing = missing_ib_devices(cfg)
    if missing and any(role != "router" for role in roles):
        print(
            f"# PD_IB_DEVICE: not checked here: this machine has none of {', '.join(missing)} under {IB_SYSFS}; "
            "the server checks its devices where it runs",
            file=out,
        )
    out.flush()
    for result in run_startup_checks(roles, cfg, secrets):
        role, status, message = result["role"], result["status"], scrub(result["message"], secrets)
        if status == "refused":
            variable = f"PD_{role.upper()}_MEM_FRACTION_STATIC"
            if role != "router" and "--mem-fraction-static" in message and variable not in message:
                fraction = getattr(cfg, f"{role}_mem_fraction_static")
                message += f"\n  (the launchers pass {variable}={'auto' if fraction is None else f'{fraction:g}'}"
                message += " as --mem-fraction-static; auto: upstream's default)"
            raise PDLaunchError(f"{role}: {message}")
        if status == "unusable":
            raise PDLaunchError(f"{role}: PD_PYTHON={cfg.python} {message}. {_interpreter_hint()}")
        print(f"# {role}: {message}", file=out)
