"""The compatibility table (``docs/design/cp-shared-kv-compatibility.md``) says what a server accepts, and no more.

* every row is proven or refused; a proven row names tests that exist, a refused row names a start-up case the
  server-args test resolves through upstream's ``ServerArgs`` (or a test of its own);
* every refusal case of that test (each of the hook's ``REFUSED_FEATURES`` has one) is cited by a row;
* every field of the pinned upstream's ``ServerArgs`` is named exactly once: in a row, or in the reviewed list of
  fields outside the KV path (a new upstream field fails here until it is placed).
"""

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="cpkv-cpu")

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "design" / "cp-shared-kv-compatibility.md"
TESTS = REPO / "test" / "registered"
VERDICTS = ("proven", "refused")


def _sections() -> tuple[list[list[str]], str]:
    text = DOC.read_text()
    table, appendix = text.split("## The table", 1)[1].split("## Outside the KV path", 1)
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| feature")
    ]
    return rows, appendix


def _row_fields(flags: str) -> list[str]:
    """The parenthesized field names that end a row's flags column."""
    group = re.search(r"\(([^()]*)\)\s*$", flags)
    return re.findall(r"`([A-Za-z_0-9]+)`", group.group(1)) if group and "`" in group.group(1) else []


def _server_args_cases():
    spec = importlib.util.spec_from_file_location(
        "server_args_cases", TESTS / "integration" / "test_cp_shared_kv_server_args.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_exists(ref: str) -> bool:
    path, name = ref.split("::")
    file = TESTS / path
    if not file.is_file():
        return False
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.parse(file.read_text()).body)


def test_every_row_is_proven_or_refused_with_its_evidence():
    rows, _ = _sections()
    cases = _server_args_cases()
    case_names = {c[0] for c in cases.BAD_CASES} | {c[0] for c in cases.UPSTREAM_REFUSED_CASES}
    assert len(rows) > 40
    for feature, _flags, verdict, evidence in rows:
        assert verdict in VERDICTS, f"{feature}: verdict {verdict!r}"
        tests = re.findall(r"`([\w/.]+\.py::\w+)`", evidence)
        cited = re.findall(r"\[([^\]]+)\]", evidence)
        assert tests or cited, f"{feature}: no evidence"
        missing = [t for t in tests if not _test_exists(t)]
        assert not missing, f"{feature}: no such test {missing}"
        unknown = [c for c in cited if c not in case_names]
        assert not unknown, f"{feature}: no start-up case named {unknown}"
        if verdict == "proven":
            assert tests and not cited, f"{feature}: a proven row names tests, not refusal cases"


def test_every_refusal_is_in_the_table():
    rows, _ = _sections()
    cases = _server_args_cases()
    evidence = " ".join(row[3] for row in rows if row[2] == "refused")
    refusal_cases = [name for name, *_ in cases.BAD_CASES] + [name for name, *_ in cases.UPSTREAM_REFUSED_CASES]
    uncited = [name for name in refusal_cases if f"[{name}]" not in evidence]
    assert not uncited, f"start-up refusals no row of the table cites: {uncited}"
    assert "test_refusals_only_a_glm5next_server_reaches" in evidence  # GLM5NEXT_ONLY's refusals


def test_every_server_args_field_is_placed_once():
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    rows, appendix = _sections()
    named = [f for row in rows for f in _row_fields(row[1])] + re.findall(r"`([A-Za-z_0-9]+)`", appendix)
    fields = {f.name for f in record_fields(ServerArgs)}
    twice = sorted({f for f in named if named.count(f) > 1})
    assert not twice, f"named more than once: {twice}"
    assert not set(named) - fields, f"not fields of upstream's ServerArgs: {sorted(set(named) - fields)}"
    assert not fields - set(named), (
        f"fields of the pinned upstream's ServerArgs the table does not place (a row, or 'Outside the KV path'): "
        f"{sorted(fields - set(named))}"
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
