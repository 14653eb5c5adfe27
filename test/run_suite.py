#!/usr/bin/env python3
"""Run a registered test suite, the way upstream SGLang's ``test/run_suite.py`` does.

Every ``test/registered/**/*.py`` file must carry at least one literal registration marker at
module level (``register_cpu_ci(...)`` / ``register_cuda_ci(...)``, from
``sglang_cpkv.testing.ci_register``); the markers are read from the file's AST, never imported.
Each selected file runs in its own process as ``python FILE`` (files end in
``sys.exit(pytest.main([__file__, ...]))``).

The run fails when any file fails, when a file collects no test (pytest exit 5), when a file is
unregistered, or when the selection is empty.

    python test/run_suite.py --hw cpu                 # the CPU suite CI runs
    python test/run_suite.py --hw cuda --suite cpkv-test-1-gpu
    python test/run_suite.py --hw cpu --list
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REGISTERED_DIR = Path(__file__).resolve().parent / "registered"
MARKERS = {"register_cpu_ci": "cpu", "register_cuda_ci": "cuda"}
DEFAULT_SUITES = {"cpu": "cpkv-cpu", "cuda": "cpkv-test-1-gpu"}
PYTEST_NO_TESTS = 5


@dataclass(frozen=True)
class Registration:
    path: Path
    hw: str
    suite: str
    est_time: float
    disabled: str | None


def _literal_kwargs(call: ast.Call, path: Path) -> dict:
    kwargs = {}
    names = ["est_time", "suite", "nightly", "disabled"]
    for name, arg in zip(names, call.args):
        kwargs[name] = ast.literal_eval(arg)
    for kw in call.keywords:
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except ValueError as exc:
            raise SystemExit(f"{path}: registration argument {kw.arg} must be a literal ({exc})") from exc
    return kwargs


def _suite_name(kwargs: dict) -> str | None:
    if kwargs.get("stage") and kwargs.get("runner_config"):
        return f"{kwargs['stage']}-test-{kwargs['runner_config']}"
    return kwargs.get("suite")


def parse_registrations(path: Path) -> list[Registration]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name not in MARKERS:
            continue
        kwargs = _literal_kwargs(node.value, path)
        suite = _suite_name(kwargs)
        if suite is None:
            raise SystemExit(f"{path}: {name}(...) names no suite (suite= or stage=+runner_config=)")
        found.append(
            Registration(path, MARKERS[name], suite, float(kwargs.get("est_time", 60)), kwargs.get("disabled"))
        )
    return found


def collect(hw: str, suite: str) -> list[Registration]:
    files = sorted(p for p in REGISTERED_DIR.rglob("*.py") if p.name != "__init__.py")
    unregistered = [p for p in files if not parse_registrations(p)]
    if unregistered:
        raise SystemExit(
            "unregistered test files (add register_cpu_ci/register_cuda_ci):\n  " + "\n  ".join(map(str, unregistered))
        )
    selected = []
    for path in files:
        for reg in parse_registrations(path):
            if reg.hw == hw and reg.suite == suite:
                selected.append(reg)
    return selected


def run_one(reg: Registration, timeout: float) -> tuple[Registration, int, float, str]:
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(
            [sys.executable, str(reg.path)],
            cwd=reg.path.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        partial = "".join(
            s.decode(errors="replace") if isinstance(s, bytes) else s for s in (exc.stdout, exc.stderr) if s
        )
        code, out = 124, f"{partial}\nTIMEOUT after {timeout:.0f}s"
    return reg, code, time.monotonic() - start, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hw", choices=sorted(DEFAULT_SUITES), required=True)
    parser.add_argument("--suite", help="suite name (default: cpkv-cpu for cpu, cpkv-test-1-gpu for cuda)")
    parser.add_argument("--jobs", type=int, default=1, help="files run in parallel")
    parser.add_argument(
        "--timeout-factor", type=float, default=4.0, help="per-file timeout = factor * est_time (min 300 s)"
    )
    parser.add_argument("--list", action="store_true", help="print the selected files and exit")
    args = parser.parse_args()
    suite = args.suite or DEFAULT_SUITES[args.hw]

    selected = collect(args.hw, suite)
    if not selected:
        print(f"no test files registered for hw={args.hw} suite={suite}", file=sys.stderr)
        return 1
    selected = [r for r in selected if not r.disabled] + [r for r in selected if r.disabled]
    if args.list:
        for reg in selected:
            print(
                f"{reg.est_time:7.0f}s  {reg.path.relative_to(REGISTERED_DIR.parent)}{'  (disabled: ' + reg.disabled + ')' if reg.disabled else ''}"
            )
        return 0

    runnable = [r for r in selected if not r.disabled]
    for reg in selected:
        if reg.disabled:
            print(f"SKIP (disabled: {reg.disabled}) {reg.path.relative_to(REGISTERED_DIR.parent)}")
    print(
        f"running {len(runnable)} files of suite {suite} (estimated {sum(r.est_time for r in runnable):.0f}s)",
        flush=True,
    )

    failed = []
    passed = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_one, r, max(300.0, args.timeout_factor * r.est_time)) for r in runnable]
        for fut in futures:
            reg, code, seconds, out = fut.result()
            rel = reg.path.relative_to(REGISTERED_DIR.parent)
            print(out.rstrip())
            if code == 0:
                passed += 1
                print(f"=== PASS {rel} ({seconds:.1f}s)", flush=True)
            else:
                why = "collected no tests" if code == PYTEST_NO_TESTS else f"exit {code}"
                failed.append(f"{rel} ({why})")
                print(f"=== FAIL {rel}: {why} ({seconds:.1f}s)", flush=True)

    print()
    for f in failed:
        print(f"FAILED FILE {f}")
    print(f"suite {suite}")
    print(f"files: {passed} passed, {len(failed)} failed")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
