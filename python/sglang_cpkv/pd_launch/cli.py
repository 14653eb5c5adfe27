"""The ``python -m sglang_cpkv.pd_launch`` command line (usage: the package docstring)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import sglang_cpkv.pd_launch as package
from sglang_cpkv.envs import envs
from sglang_cpkv.pd_launch.commands import shell_command
from sglang_cpkv.pd_launch.config import ONE_HOST_DEFAULTS, ROLES, PDConfig, PDLaunchError, require_role
from sglang_cpkv.pd_launch.dry_run import dry_run
from sglang_cpkv.pd_launch.lifecycle import Interrupted, run_role, start, status, stop, up, wait_healthy

EXIT_REFUSED = 2  # a PDLaunchError: bad settings, a refused command, a role that did not start or stop
EXIT_INTERRUPTED = 130  # Ctrl-C: what had started was stopped (128 + SIGINT, as a shell reports it)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_cpkv.pd_launch", description=package.__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dry-run", help="print the commands and run the servers' start-up checks (CPU, PD_PYTHON)")
    p.add_argument("roles", nargs="*", default=list(ROLES))
    p = sub.add_parser("print", help="print one role's command, shell-quoted, secret values redacted")
    p.add_argument("role")
    p = sub.add_parser("start", help="start a role in the background and wait until it is healthy")
    p.add_argument("role")
    p.add_argument("--no-wait", action="store_true", help="return once started, without the health wait")
    p = sub.add_parser("run", help="run a role in the foreground (container entry point)")
    p.add_argument("role")
    # What `start` launches: no copy of the output on stdout, into the log `start` created.
    p.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log", type=Path, default=None, help=argparse.SUPPRESS)
    sub.add_parser("up", help="one host: start prefill, decode and router in order (decode GPUs after the prefill's)")
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
            return run_role(require_role(args.role), cfg, echo=not args.detached, log_path=args.log)
        elif args.command == "up":
            # One host: the servers' sizes split it and the decode's GPUs follow the prefill's, unless chosen (the
            # roles inherit the environment).
            chosen = {name: value for name, value in ONE_HOST_DEFAULTS.items() if not envs.field(name).is_set()}
            os.environ.update(chosen)
            cfg = PDConfig.from_env()
            if not envs.PD_DECODE_BASE_GPU_ID.is_set():
                envs.PD_DECODE_BASE_GPU_ID.set(cfg.prefill_base_gpu_id + cfg.prefill_tp)
                cfg = PDConfig.from_env()
            if chosen:
                print(
                    f"pd_launch: one host: {', '.join(f'{k}={v}' for k, v in chosen.items())} (unset)", file=sys.stderr
                )
            up(cfg)
        elif args.command == "wait":
            wait_healthy(require_role(args.role), cfg)
        elif args.command == "status":
            return 0 if status(args.roles, cfg) else 1
        elif args.command == "stop":
            stop(args.roles, cfg)
    except Interrupted as exc:
        print(f"pd_launch: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before anything started
        print("pd_launch: interrupted; nothing was started", file=sys.stderr)
        return EXIT_INTERRUPTED
    except PDLaunchError as exc:
        print(f"pd_launch: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return 0
