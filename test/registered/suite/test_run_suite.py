"""test/run_suite.py itself, on a temporary directory of tiny registered files.

Each case writes one or two registered files and runs the real runner on that directory (``--root``),
in its own process, as CI does: a file whose tests all skip fails unless its marker says why it may
(``may_skip="..."``), a file that collects nothing fails, a file with one test run and one skipped
passes, a ``may_skip`` that is not a reason is refused, and the longest file (``est_time``) starts first.
"""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="cpkv-cpu")

RUN_SUITE = Path(__file__).resolve().parents[2] / "run_suite.py"

HEADER = textwrap.dedent(
    """\
    import sys

    import pytest

    from sglang_cpkv.testing.ci_register import register_cpu_ci

    register_cpu_ci(est_time=1, suite="cpkv-cpu"{marker_extra})
    """
)
FOOTER = '\n\nif __name__ == "__main__":\n    sys.exit(pytest.main([__file__, "-q"]))\n'
ALL_SKIPPED = 'def test_a():\n    pytest.skip("no widget here")\n\n\ndef test_b():\n    pytest.skip("no widget here")\n'
ONE_RUNS = 'def test_a():\n    assert 1 + 1 == 2\n\n\ndef test_b():\n    pytest.skip("no widget here")\n'
NO_TESTS = "HELPER = 1\n"


def write(root: Path, name: str, body: str, marker_extra: str = "") -> None:
    (root / name).write_text(HEADER.format(marker_extra=marker_extra) + "\n\n" + body + FOOTER)


def run_suite(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUN_SUITE), "--hw", "cpu", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_all_skipped_without_a_declaration_fails(tmp_path):
    write(tmp_path, "test_widget.py", ALL_SKIPPED)
    ran = run_suite(tmp_path)
    assert ran.returncode == 1, ran.stdout
    assert "=== FAIL" in ran.stdout and "all 2 tests skipped" in ran.stdout and 'may_skip="..."' in ran.stdout
    assert "files: 0 passed, 1 failed" in ran.stdout


def test_all_skipped_with_a_declared_reason_passes_and_says_why(tmp_path):
    write(tmp_path, "test_widget.py", ALL_SKIPPED, ', may_skip="no widget outside the lab"')
    ran = run_suite(tmp_path)
    assert ran.returncode == 0, ran.stdout
    assert "all 2 tests skipped, as declared: no widget outside the lab" in ran.stdout


def test_a_file_with_one_test_run_passes(tmp_path):
    write(tmp_path, "test_widget.py", ONE_RUNS)
    ran = run_suite(tmp_path)
    assert ran.returncode == 0, ran.stdout
    assert "=== PASS" in ran.stdout and "2 tests, 1 skipped" in ran.stdout


def test_a_file_that_collects_nothing_fails_next_to_a_passing_one(tmp_path):
    write(tmp_path, "test_empty.py", NO_TESTS)
    write(tmp_path, "test_widget.py", ONE_RUNS)
    ran = run_suite(tmp_path)
    assert ran.returncode == 1, ran.stdout
    assert "test_empty.py: collected no tests" in ran.stdout
    assert "files: 1 passed, 1 failed" in ran.stdout


def test_the_longest_file_runs_first(tmp_path):
    """Files start longest first by est_time (with --jobs 2 a long file started last would run alone at the end)."""
    write(tmp_path, "test_a_short.py", ONE_RUNS)
    long_header = HEADER.format(marker_extra="").replace("est_time=1,", "est_time=50,")
    (tmp_path / "test_b_long.py").write_text(long_header + "\n\n" + ONE_RUNS + FOOTER)
    ran = run_suite(tmp_path)
    assert ran.returncode == 0, ran.stdout
    passes = [line.split()[2] for line in ran.stdout.splitlines() if line.startswith("=== PASS")]
    assert passes == [f"{tmp_path.name}/test_b_long.py:", f"{tmp_path.name}/test_a_short.py:"], ran.stdout
    assert re.search(r"files: 2 passed, 0 failed \(\d+s wall, --jobs 1\)", ran.stdout), ran.stdout


@pytest.mark.parametrize("value", ['""', "True"])
def test_may_skip_must_be_a_reason(tmp_path, value):
    write(tmp_path, "test_widget.py", ALL_SKIPPED, f", may_skip={value}")
    ran = run_suite(tmp_path)
    assert ran.returncode != 0 and "may_skip=...) must be the reason, a non-empty string" in ran.stderr


def test_every_registered_file_runs_pytest_on_itself():
    """The runner runs each registered file as a script: one without this footer writes no report and fails CI."""
    registered = RUN_SUITE.parent / "registered"
    files = [f for f in registered.rglob("test_*.py") if "register_" in f.read_text(encoding="utf-8")]
    assert len(files) > 40
    footer = re.compile(r'\nif __name__ == "__main__":\n    sys\.exit\(pytest\.main\(\[__file__(, "-[a-z]")*\]\)\)\n\Z')
    assert [str(f.relative_to(registered)) for f in files if not footer.search(f.read_text(encoding="utf-8"))] == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
