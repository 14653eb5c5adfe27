"""The mutation record of the compatibility table (``docs/design/cp-shared-kv-mutations.toml``) stays usable.

``make mutation`` (``scripts/mutation.py``, not part of this suite: it runs the kit tests once per mutation) applies
each one-line change and runs the row's named tests. Here, on every run: every proven row of the table has a
mutation, every mutation names a proven row, and its line is in its file exactly once (so a mutation cannot rot into
a change that is no longer made); the check itself finds each of those faults; and the committed report holds every
mutation of the record as it is now, caught.
"""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]


def _tool():
    spec = importlib.util.spec_from_file_location("cpkv_mutation", REPO / "scripts" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_proven_row_has_a_mutation_whose_line_is_in_its_file_once():
    tool = _tool()
    rows, muts = tool.proven_rows(), tool.mutations()
    assert len(rows) >= 20 and all(refs for refs in rows.values()), rows
    assert tool.record_problems(rows, muts) == []


def test_the_record_check_finds_a_missing_row_a_stale_line_and_an_unknown_row():
    tool = _tool()
    rows, muts = tool.proven_rows(), tool.mutations()
    first = muts[0]
    without_row = [m for m in muts if m.row != first.row]
    assert any(first.row in p and "no mutation" in p for p in tool.record_problems(rows, without_row))
    stale = dataclasses.replace(first, find=first.find + "  # a line that is not in the file")
    assert any("occurs 0 times" in p for p in tool.record_problems(rows, [stale, *muts[1:]]))
    unknown = dataclasses.replace(first, row="a row the table does not have")
    assert any("not a proven row" in p for p in tool.record_problems(rows, [unknown, *muts]))
    no_change = dataclasses.replace(first, replace=first.find)
    assert any("not a one-line change" in p for p in tool.record_problems(rows, [no_change, *muts[1:]]))


def test_the_committed_report_has_every_mutation_of_the_record_caught():
    """The committed report judges the record as it is: a mutation added or changed since the report was written has
    no line there (run ``scripts/mutation.py --row ROW`` for its row; a ``gpu`` one with ``--gpu-only`` on a GPU
    host), and a line that is not ``caught`` is a feature its row's tests do not protect."""
    tool = _tool()
    muts = tool.mutations()
    lines = tool.committed_lines(muts)
    unjudged = [m.label for m in muts if m.label not in lines]
    assert len({m.label for m in muts}) == len(muts), "two mutations of the record share a name"
    assert not unjudged, "mutations without a line in the committed report:\n  " + "\n  ".join(unjudged)
    not_caught = {label: tool.verdict_of(line) for label, line in lines.items() if tool.verdict_of(line) != "caught"}
    assert not not_caught, not_caught
    changed = dataclasses.replace(muts[0], replace=muts[0].replace + "  # another change")
    assert changed.label not in tool.committed_lines([changed]), "a changed mutation kept its old verdict"


@pytest.mark.parametrize("row", ["IndexShare", "radix cache"])
def test_the_table_parser_reads_the_rows_named_tests(row):
    refs = _tool().proven_rows()[row]
    assert refs and all("::" in ref and (REPO / "test" / "registered" / ref.split("::")[0]).is_file() for ref in refs)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
