#!/usr/bin/env python3
"""Run a registered test suite, the way upstream SGLang's ``test/run_suite.py`` does.

Every ``test/registered/**/*.py`` file must carry at least one literal registration marker at
module level (``register_cpu_ci(...)`` / ``register_cuda_ci(...)``, from
``sglang_cpkv.testing.ci_register``); the markers are read from the file's AST, never imported.
Each selected file runs in its own process as ``python FILE`` (files end in
``sys.exit(pytest.main([__file__, ...]))``), with pytest's JUnit report (``PYTEST_ADDOPTS``) telling
the runner how many of its tests ran and how many skipped.

The run fails when any file fails, when a file collects no test (pytest exit 5), when every test of a
file skipped, when a file is unregistered, or when the selection is empty. A file that may
legitimately skip all its tests on some hardware says why on that marker, as a literal string:

    register_cpu_ci(est_time=150, suite="cpkv-cpu", may_skip="nvcc is not on PATH outside CI")

and an all-skipped run of it passes, printing the reason (``disabled=`` instead keeps a file from
running at all). Files start longest first by ``est_time`` (keep it the file's measured seconds on the 2-core CI
machine), so with ``--jobs 2`` no long file is left to run alone at the end.

    python test/run_suite.py --hw cpu --jobs 2        # the CPU suite CI runs
    python test/run_suite.py --hw cuda --suite cpkv-test-1-gpu
    python test/run_suite.py --hw cpu --list
"""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
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
    may_skip: str | None  # why every test of the file may skip on this hardware


@dataclass(frozen=True)
class Outcome:
    code: int
    seconds: float
    output: str
    tests: int | None  # from the file's JUnit report; None when it wrote none
    skipped: int | None


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
        may_skip = kwargs.get("may_skip")
        if may_skip is not None and not (isinstance(may_skip, str) and may_skip.strip()):
            raise SystemExit(f"{path}: {name}(may_skip=...) must be the reason, a non-empty string")
        found.append(
            Registration(
                path, MARKERS[name], suite, float(kwargs.get("est_time", 60)), kwargs.get("disabled"), may_skip
            )
        )
    return found


def collect(root: Path, hw: str, suite: str) -> list[Registration]:
    files = sorted(p for p in root.rglob("*.py") if p.name != "__init__.py")
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


def _junit_counts(report: Path) -> tuple[int | None, int | None]:
    """(tests, skipped) over the report's test suites; (None, None) when there is no readable report."""
    try:
        root = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError):
        return None, None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return sum(int(s.get("tests", 0)) for s in suites), sum(int(s.get("skipped", 0)) for s in suites)


def run_one(reg: Registration, timeout: float, report: Path) -> Outcome:
    start = time.monotonic()
    addopts = " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS", ""), f"--junitxml={shlex.quote(str(report))}"]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTEST_ADDOPTS=addopts)
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
    tests, skipped = _junit_counts(report)
    return Outcome(code, time.monotonic() - start, out, tests, skipped)


def verdict(reg: Registration, outcome: Outcome) -> tuple[bool, str]:
    """(passed, what to say) for one file's run."""
    if outcome.code == PYTEST_NO_TESTS:
        return False, "collected no tests"
    if outcome.code != 0:
        return False, f"exit {outcome.code}"
    if outcome.tests is None:
        return False, "wrote no pytest report (does it end in sys.exit(pytest.main([__file__, ...]))?)"
    if outcome.tests and outcome.skipped == outcome.tests:
        if reg.may_skip:
            return True, f"all {outcome.tests} tests skipped, as declared: {reg.may_skip}"
        return False, (
            f"all {outcome.tests} tests skipped (if that is expected on this hardware, say why with "
            f'may_skip="..." on its register_{reg.hw}_ci marker)'
        )
    skipped = f", {outcome.skipped} skipped" if outcome.skipped else ""
    return True, f"{outcome.tests} test{'' if outcome.tests == 1 else 's'}{skipped}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hw", choices=sorted(DEFAULT_SUITES), required=True)
    parser.add_argument("--suite", help="suite name (default: cpkv-cpu for cpu, cpkv-test-1-gpu for cuda)")
    parser.add_argument("--jobs", type=int, default=1, help="files run in parallel")
    parser.add_argument(
        "--timeout-factor", type=float, default=4.0, help="per-file timeout = factor * est_time (min 300 s)"
    )
    parser.add_argument("--list", action="store_true", help="print the selected files and exit")
    parser.add_argument(
        "--root",
        type=Path,
        default=REGISTERED_DIR,
        help=f"directory of the registered files (default {REGISTERED_DIR})",
    )
    args = parser.parse_args()
    suite = args.suite or DEFAULT_SUITES[args.hw]
    root = args.root.resolve()

    selected = collect(root, args.hw, suite)
    if not selected:
        print(f"no test files registered for hw={args.hw} suite={suite}", file=sys.stderr)
        return 1
    selected = [r for r in selected if not r.disabled] + [r for r in selected if r.disabled]
    if args.list:
        for reg in selected:
            print(
                f"{reg.est_time:7.0f}s  {reg.path.relative_to(root.parent)}{'  (disabled: ' + reg.disabled + ')' if reg.disabled else ''}"
            )
        return 0

    # Longest first (by est_time): with --jobs > 1 a long file started last would run alone at the end.
    runnable = sorted((r for r in selected if not r.disabled), key=lambda r: -r.est_time)
    for reg in selected:
        if reg.disabled:
            print(f"SKIP (disabled: {reg.disabled}) {reg.path.relative_to(root.parent)}")
    print(
        f"running {len(runnable)} files of suite {suite} (estimated {sum(r.est_time for r in runnable):.0f}s)",
        flush=True,
    )

    failed = []
    passed = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="run_suite-") as reports, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [
            pool.submit(run_one, r, max(300.0, args.timeout_factor * r.est_time), Path(reports) / f"{i}.xml")
            for i, r in enumerate(runnable)
        ]
        for reg, fut in zip(runnable, futures):
            outcome = fut.result()
            rel = reg.path.relative_to(root.parent)
            print(outcome.output.rstrip())
            ok, what = verdict(reg, outcome)
            if ok:
                passed += 1
                print(f"=== PASS {rel}: {what} ({outcome.seconds:.1f}s)", flush=True)
            else:
                failed.append(f"{rel} ({what})")
                print(f"=== FAIL {rel}: {what} ({outcome.seconds:.1f}s)", flush=True)

    print()
    for f in failed:
        print(f"FAILED FILE {f}")
    print(f"suite {suite}")
    print(f"files: {passed} passed, {len(failed)} failed ({time.monotonic() - start:.0f}s wall, --jobs {args.jobs})")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
