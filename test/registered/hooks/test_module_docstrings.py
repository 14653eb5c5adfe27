"""Every module of ``sglang_cpkv`` has a docstring of at most 10 lines: its role, its callers and a pointer into
``docs/design/`` (or ``docs/operations.md``, ``docs/rebase.md``); the design itself lives in those documents once."""

import ast
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="cpkv-cpu")

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "python" / "sglang_cpkv"
MAX_LINES = 10


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _docstring_lines(path: Path) -> int | None:
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    return None if doc is None else len(doc.splitlines())


def test_every_module_has_a_docstring():
    modules = _modules()
    assert len(modules) > 50
    missing = [str(p.relative_to(PACKAGE)) for p in modules if _docstring_lines(p) is None]
    assert missing == [], f"modules without a docstring: {missing}"


def test_every_module_docstring_is_at_most_ten_lines():
    too_long = {
        str(p.relative_to(PACKAGE)): n for p in _modules() if (n := _docstring_lines(p)) is not None and n > MAX_LINES
    }
    assert too_long == {}, (
        f"module docstrings over {MAX_LINES} lines (role, callers, a pointer into docs/design/; the design goes "
        f"to the design doc): {too_long}"
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
