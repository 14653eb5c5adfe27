#!/usr/bin/env python3
"""Do the compatibility table's named tests catch a broken feature? A mutation check of its proven rows.

``docs/design/cp-shared-kv-mutations.toml`` gives, for every row of ``docs/design/cp-shared-kv-compatibility.md``
that says *proven*, one-line changes to our code that break that feature. For each change this script makes a
scratch copy of the working tree, replaces the one line there, and runs the row's named tests (its evidence column)
against the copy (its ``python/`` first on ``PYTHONPATH``, ahead of the editable install): **caught** when they
fail, **missed** when they pass. The unchanged copy runs them first and must pass (else nothing can be judged).
CUDA test files (``*_cuda.py``) run only with ``--cuda`` (a host with a GPU and what the CPU tests need); a mutation
only they can see (``gpu = true``: a CUDA launcher's line) keeps its committed verdict on a CPU host (not run where it
has none). ``--gpu-only`` judges just those mutations with just the CUDA test files, for the device machine, whose
environment lacks what some CPU tests need (the upstream wheel cache of the start-up tests).

    make mutation                                                   # every mutation; writes the report below
    .venv/bin/python scripts/mutation.py --row IndexShare            # one row again, the others' lines kept
    .venv/bin/python scripts/mutation.py --unjudged --tests soak/    # new mutations, with the soak's test only
    python3 scripts/mutation.py --row device --gpu-only --no-report  # the device machine's part, printed only

Report: ``docs/design/cp-shared-kv-mutations-report.md``. Not part of ``make test`` (it runs the kit tests once per
mutation); ``test/registered/integration/test_cp_shared_kv_mutations.py`` checks the record itself in CI: every
proven row has a mutation, every mutation's line is in its file exactly once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "design" / "cp-shared-kv-compatibility.md"
RECORD = REPO / "docs" / "design" / "cp-shared-kv-mutations.toml"
REPORT = REPO / "docs" / "design" / "cp-shared-kv-mutations-report.md"
TESTS = Path("test") / "registered"
NEEDS_GPU = "not run (needs a GPU)"
TEST_REF = re.compile(r"`([\w/]+\.py)::(\w+)`")


@dataclass(frozen=True)
class Mutation:
    row: str
    file: str
    find: str
    replace: str
    breaks: str
    gpu: bool = False  # only the row's CUDA test files can see it: judged with --cuda only

    @property
    def label(self) -> str:
        """The mutation's name: its row and change (two rows may protect the same line with the same change)."""
        return f"{self.row}: {self.file}: `{self.find.strip()}` -> `{self.replace.strip()}`"


def proven_rows(table: str | None = None) -> dict[str, list[str]]:
    """Each proven row's feature name -> the tests its evidence column names (``path::test`` under test/registered)."""
    text = TABLE.read_text() if table is None else table
    body = text.split("## The table", 1)[1].split("## Outside the KV path", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and cells[2] == "proven":
            rows[cells[0]] = [f"{path}::{name}" for path, name in TEST_REF.findall(cells[3])]
    return rows


def mutations(record: str | None = None) -> list[Mutation]:
    data = tomllib.loads(RECORD.read_text() if record is None else record)
    return [Mutation(**entry) for entry in data["mutation"]]


def record_problems(rows: dict[str, list[str]], muts: list[Mutation], root: Path = REPO) -> list[str]:
    """What is wrong with the record: a proven row without a mutation, a mutation of no proven row, a line that is
    not in its file exactly once, a change that is no change or spans lines."""
    problems = [f"proven row {row!r} has no mutation" for row in rows if row not in {m.row for m in muts}]
    for m in muts:
        if m.row not in rows:
            problems.append(f"{m.label}: row {m.row!r} is not a proven row of the table")
        path = root / m.file
        count = path.read_text().count(m.find) if path.is_file() else 0
        if count != 1:
            problems.append(f"{m.label}: the line occurs {count} times in {m.file}, not once")
        if m.find == m.replace or "\n" in m.find.strip("\n") or "\n" in m.replace.strip("\n"):
            problems.append(f"{m.label}: not a one-line change")
    return problems


def _scratch_copy() -> Path:
    """The working tree as it is now (edits included), without what git ignores at the top (virtual environments,
    caches, wheels) and without bytecode, in a fresh directory."""
    dest = Path(tempfile.mkdtemp(prefix="cpkv-mutation-")) / "tree"
    skip = {".git", ".venv", ".cache", ".whl", ".ab", "build"}
    shutil.copytree(
        REPO,
        dest,
        symlinks=True,
        ignore=lambda where, names: [
            n
            for n in names
            if n in ("__pycache__", ".hypothesis", ".pytest_cache") or (where == str(REPO) and n in skip)
        ],
    )
    return dest


def _scratch_env(root: Path) -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root / "python"), os.environ.get("PYTHONPATH")]))
    )


def _run_tests(root: Path, refs: list[str], timeout: int) -> tuple[int, float, str]:
    env = _scratch_env(root)
    env.setdefault("TRITON_INTERPRET", "1")
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *refs],
            cwd=root / TESTS,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, f"timed out after {timeout} s"
    lines = [line for line in out.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line or "error" in line), "")
    return rc, time.monotonic() - start, summary or (lines[-1] if lines else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row", action="append", help="only this row's mutations (repeatable)")
    parser.add_argument("--cuda", action="store_true", help="also run the rows' CUDA test files (a GPU host)")
    parser.add_argument("--gpu-only", action="store_true", help="only the gpu mutations, with the CUDA test files")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run of a row's tests")
    parser.add_argument("--no-report", action="store_true", help="print only; leave the committed report alone")
    parser.add_argument(
        "--unjudged",
        action="store_true",
        help="only the mutations without a line in the committed report (new, changed)",
    )
    parser.add_argument(
        "--tests",
        metavar="SUBSTRING",
        help="only the row's tests whose path::name contains this (a subset that fails "
        "proves the row's tests catch the change)",
    )
    args = parser.parse_args(argv)

    rows, muts = proven_rows(), mutations()
    problems = record_problems(rows, muts)
    if problems:
        print("the mutation record is broken:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    if args.row:
        muts = [m for m in muts if m.row in args.row]
    if args.unjudged:
        committed = committed_lines()
        muts = [m for m in muts if m.label not in committed]
    if args.gpu_only:
        args.cuda, muts = True, [m for m in muts if m.gpu]
        if not muts:
            print("no gpu mutation in the rows asked for", file=sys.stderr)
            return 2
    runnable = {
        row: [r for r in refs if args.cuda or not r.split("::")[0].endswith("_cuda.py")] for row, refs in rows.items()
    }

    def refs_of(m: Mutation) -> list[str]:
        """The row's tests that can see the mutation: a CUDA launcher's line (``gpu``) only the CUDA test files run (a
        row's CPU tests may need what a GPU host lacks, the upstream wheel cache of the start-up tests)."""
        refs = [r for r in runnable[m.row] if args.tests is None or args.tests in r]
        return [r for r in refs if r.split("::")[0].endswith("_cuda.py")] if m.gpu else refs

    results = []
    root = _scratch_copy()
    try:
        baseline = sorted({ref for m in muts for ref in refs_of(m)})
        print(f"[mutation] the unchanged tree: {len(baseline)} tests", flush=True)
        rc, seconds, summary = _run_tests(root, baseline, args.timeout)
        print(f"[mutation]   {summary} ({seconds:.0f} s)", flush=True)
        if rc != 0:
            print("[mutation] the named tests fail on the unchanged tree: nothing can be judged", file=sys.stderr)
            return 1
        for i, m in enumerate(muts, 1):
            refs = refs_of(m)
            print(f"[mutation] {i}/{len(muts)} {m.label}", flush=True)
            if not refs:
                results.append((m, NEEDS_GPU, 0.0, ""))
                continue
            path = root / m.file
            original = path.read_text()
            path.write_text(original.replace(m.find, m.replace, 1))
            try:
                rc, seconds, summary = _run_tests(root, refs, args.timeout)
            finally:
                path.write_text(original)
            verdict = "missed" if rc == 0 else "caught"
            results.append((m, verdict, seconds, summary))
            print(f"[mutation]   {verdict}: {summary} ({seconds:.0f} s)", flush=True)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)

    # A mutation only a GPU can judge keeps the committed report's verdict on a CPU host.
    judged = [r for r in results if r[1] != NEEDS_GPU]
    ran = f"the row's tests matching `{args.tests}`: " if args.tests else ""
    lines = {m.label: _report_line(m, verdict, seconds, ran + summary) for m, verdict, seconds, summary in judged}
    report = _report(lines, args.cuda, args.row, args.gpu_only)
    print(report)
    if not args.no_report:
        REPORT.write_text(report)
    return 1 if any(r[1] == "missed" for r in results) else 0


def _report_line(m: Mutation, verdict: str, seconds: float, summary: str) -> str:
    change = f"`{m.file}`: `{m.find.strip()}` -> `{m.replace.strip()}`".replace("|", "\\|")
    return f"| {m.row} | {change} | {m.breaks} | **{verdict}** | {summary} ({seconds:.0f} s) |"


def _report(lines: dict[str, str], cuda: bool, rows: list[str] | None, gpu_only: bool = False) -> str:
    """The report of every mutation of the record, in its order: the lines of this run, and for the others (other
    rows, or a GPU's mutation on a CPU host) the committed report's line of the same change, else "not run"."""
    kept = committed_lines()
    table = [
        lines.get(m.label) or kept.get(m.label) or _report_line(m, NEEDS_GPU if m.gpu else "not run", 0, "")
        for m in mutations()
    ]
    verdicts = [verdict_of(line) for line in table]
    which = "rows " + ", ".join(rows) if rows else "every row"
    if gpu_only:
        ran = f"the gpu mutations of {which} re-run, `--gpu-only`"
    else:
        ran = f"{which} re-run" if rows else which
    return (
        "\n".join(
            [
                "# Mutation report of the compatibility table's proven rows",
                "",
                f"Written by `make mutation` ({ran}, {'with' if cuda else 'without'} the CUDA test files) on "
                f"{time.strftime('%Y-%m-%d')}: {verdicts.count('caught')} caught, {verdicts.count('missed')} missed, "
                f"{len(verdicts) - verdicts.count('caught') - verdicts.count('missed')} not run, of {len(verdicts)} "
                "mutations (`docs/design/cp-shared-kv-mutations.toml`). Each ran the row's named tests against a scratch "
                "copy of the tree with the one line changed; a line this run did not judge (another row's, or a GPU's "
                "mutation on a CPU host) is the earlier report's.",
                "",
                "| row | change | breaks | result | tests (seconds) |",
                "|---|---|---|---|---|",
                *table,
            ]
        )
        + "\n"
    )


def committed_lines(muts: list[Mutation] | None = None) -> dict[str, str]:
    """The committed report's line of each mutation of ``muts`` (default: the record's), found by its row, change
    and effect: a mutation changed since the report was written has none."""
    committed = REPORT.read_text().splitlines() if REPORT.is_file() else []
    muts = mutations() if muts is None else muts
    found = {m.label: next((line for line in committed if _is_line_of(m, line)), None) for m in muts}
    return {label: line for label, line in found.items() if line is not None}


def verdict_of(line: str) -> str:
    """The verdict of a report line (``caught``, ``missed``, ``not run``...)."""
    return line.split(" | ")[3].strip("*")


def _is_line_of(m: Mutation, line: str) -> bool:
    """Whether ``line`` is a report's line of ``m`` (same row, change and effect)."""
    head = _report_line(m, "", 0, "").split(" | **")[0]
    return line.startswith(head + " | **")


if __name__ == "__main__":
    sys.exit(main())
