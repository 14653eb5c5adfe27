"""The settings registry (:mod:`sglang_cpkv.envs`) is the one place the package reads its environment, and the
documented settings table agrees with it.

* Every field has a scope and a one-line description; no name is declared twice (old names included).
* The settings table (``SETTINGS_DOC``: the table whose first column holds variable names) lists every user-facing
  field, and every ``SGLANG_*``/``CPKV_*`` variable it mentions is declared.
* No module of the package reads ``os.environ`` itself, and every ``SGLANG_CPKV_*`` name in its sources is declared.
* The upstream variables we read parse and default as upstream's own ``sglang/srt/environ.py`` does.
* ``SGLANG_CPKV_CUDA_JIT`` is a boolean like the others: ``true`` allows the JIT build (it once had to be ``1``).
"""

import ast
import re
import sys
from pathlib import Path

import pytest

from sglang_cpkv.envs import (
    EXTERNAL,
    OVERLAY,
    PD_LAUNCH,
    SERVING,
    TESTING,
    UPSTREAM,
    EnvBool,
    Envs,
    UpstreamBool,
    envs,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
# The document whose settings table is checked (repoint here if the table moves, e.g. to docs/operations.md).
SETTINGS_DOC = REPO / "README.md"
PACKAGE = REPO / "python" / "sglang_cpkv"
# Modules that may read os.environ themselves: the registry; and the P/D stand-in server, a program of its own run
# as a file (standard library only) that stands for upstream's server and reads the test protocol's STUB_* variables.
DIRECT_READERS = {"envs.py", "env.py", "testing/pd_stub.py"}
VARIABLE = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")
OURS_OR_UPSTREAMS = re.compile(r"\b(?:SGLANG|CPKV)_[A-Z0-9_]*[A-Z0-9]\b")


def _declared_names() -> set[str]:
    return {name for field in Envs.fields().values() for name in field.names}


# ---------------------------------------------------------------------------------- the registry itself


def test_every_field_is_declared_once_with_a_scope_and_a_description():
    fields = Envs.fields()
    assert len(fields) > 20
    names = [name for field in fields.values() for name in field.names]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    for name, field in fields.items():
        assert field.name == name
        assert field.scope in (SERVING, OVERLAY, PD_LAUNCH, TESTING, UPSTREAM, EXTERNAL), name
        assert field.doc and "\n" not in field.doc, name
        assert Envs.field(name) is field
    assert Envs.field("SGLANG_CP_DRAFT_SHARED_KV") is envs.SGLANG_CPKV_DRAFT_SHARED_KV
    with pytest.raises(KeyError, match="SGLANG_CPKV_NOT_A_SETTING is not declared"):
        Envs.field("SGLANG_CPKV_NOT_A_SETTING")


# ---------------------------------------------------------------------------------- the documented table


def _tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of ``text``: its rows (header first, the separator row left out) as lists of cells."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def _settings_table() -> list[list[str]]:
    """The table whose first column names variables (the most such rows, if several do)."""

    def named_rows(table: list[list[str]]) -> int:
        return sum(bool(OURS_OR_UPSTREAMS.search(" ".join(re.findall(r"`([^`]*)`", row[0])))) for row in table[1:])

    tables = [t for t in _tables(SETTINGS_DOC.read_text()) if named_rows(t)]
    assert tables, f"no table in {SETTINGS_DOC} has variable names in its first column"
    return max(tables, key=named_rows)


def test_the_table_is_found_by_its_structure():
    table = _settings_table()
    first_column = " ".join(row[0] for row in table[1:])
    assert "SGLANG_CPKV_OPS_BACKEND" in first_column and len(table) > 3


def test_every_user_facing_setting_has_a_row():
    first_column = {
        m for row in _settings_table()[1:] for span in re.findall(r"`([^`]*)`", row[0]) for m in VARIABLE.findall(span)
    }
    missing = sorted(name for name, field in Envs.fields().items() if field.user_facing and name not in first_column)
    assert not missing, f"user-facing settings without a row in {SETTINGS_DOC.name}'s settings table: {missing}"


def test_every_variable_the_table_names_is_declared():
    mentioned = {m for row in _settings_table() for cell in row for m in OURS_OR_UPSTREAMS.findall(cell)}
    undeclared = sorted(mentioned - _declared_names())
    assert not undeclared, (
        f"{SETTINGS_DOC.name}'s settings table names variables sglang_cpkv.envs does not declare: {undeclared}"
    )


# ---------------------------------------------------------------------------------- the package reads through it


def _direct_reads(path: Path, root: Path = PACKAGE) -> list[str]:
    """``os.environ.get(..)``, ``os.getenv(..)``, ``os.environ[..]`` read, ``.. in os.environ`` in ``path``."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)

    def reads(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            getenv = node.func.attr == "getenv" and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
            return getenv or (node.func.attr == "get" and is_environ(node.func.value))
        if isinstance(node, ast.Subscript):
            return is_environ(node.value) and isinstance(node.ctx, ast.Load)
        return isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators)

    return [f"{path.relative_to(root)}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text())) if reads(node)]


def test_no_module_reads_the_environment_past_the_registry():
    reads = [
        read
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() not in DIRECT_READERS
        for read in _direct_reads(path)
    ]
    assert not reads, f"read these through sglang_cpkv.envs: {reads}"


def test_the_check_sees_a_direct_read(tmp_path):
    source = tmp_path / "reader.py"
    source.write_text(
        "import os\na = os.environ.get('A')\nb = os.getenv('B')\nc = os.environ['C']\nd = 'D' in os.environ\n"
    )
    assert len(_direct_reads(source, tmp_path)) == 4


def test_every_sglang_cpkv_name_in_the_package_is_declared():
    used = {
        m for path in PACKAGE.rglob("*.py") for m in re.findall(r"\bSGLANG_CPKV_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    assert used and not sorted(used - _declared_names()), sorted(used - _declared_names())


# ---------------------------------------------------------------------------------- upstream's variables


SPELLINGS = ("1", "0", "true", "false", "True", "FALSE", "yes", "no", "y", "n", "on", "off", "2", "maybe")


def test_upstream_variables_read_as_upstream_reads_them():
    from sglang_cpkv.testing.upstream_env import skip_or_fail

    try:
        from sglang.srt.environ import envs as upstream_envs
    except ImportError as exc:
        skip_or_fail(f"upstream sglang does not import here: {exc}")
    fields = Envs.in_scope(UPSTREAM)
    assert fields
    for name, field in fields.items():
        theirs = getattr(upstream_envs, name, None)
        assert theirs is not None, f"upstream no longer declares {name}"
        assert field.default == theirs.default, name
        if isinstance(theirs.default, bool):
            assert isinstance(field, UpstreamBool), name
            for text in SPELLINGS:
                try:
                    expected = theirs.parse(text)
                except ValueError:
                    expected = ValueError
                try:
                    got = field.parse(name, text)
                except ValueError:
                    got = ValueError
                assert got == expected, (name, text)


def test_our_booleans_read_one_set_of_spellings():
    ours = [field for field in Envs.fields().values() if isinstance(field, EnvBool)]
    assert all(type(field) is EnvBool or field.scope == UPSTREAM for field in ours)
    for text, expected in (("1", True), ("true", True), ("ON", True), ("Yes", True), ("0", False), ("off", False)):
        assert all(field.parse(field.name, text) is expected for field in ours if type(field) is EnvBool)


# ---------------------------------------------------------------------------------- SGLANG_CPKV_CUDA_JIT


@pytest.mark.parametrize("value, builds", [("true", True), ("1", True), ("on", True), ("0", False), (None, False)])
def test_cuda_jit_is_a_boolean(monkeypatch, value, builds):
    """With no prebuilt library, the backend JIT-builds exactly when SGLANG_CPKV_CUDA_JIT reads as true (``true`` was
    once read as off: the loader compared the text with ``"1"``)."""
    from sglang_cpkv.ops import cuda, cuda_build

    built = []
    monkeypatch.setattr(cuda.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_build, "prebuilt_library", lambda: None)
    monkeypatch.setattr(cuda_build, "jit_build", lambda: built.append(True))
    monkeypatch.setattr(cuda, "_ops_registered", lambda: bool(built))
    monkeypatch.setattr(cuda, "_register_fakes", lambda: None)
    monkeypatch.setattr(cuda, "_loaded", cuda._loaded)
    if value is None:
        monkeypatch.delenv(envs.SGLANG_CPKV_CUDA_JIT.name, raising=False)
    else:
        monkeypatch.setenv(envs.SGLANG_CPKV_CUDA_JIT.name, value)
    cuda._load.cache_clear()
    try:
        reason = cuda._load()
    finally:
        cuda._load.cache_clear()
    assert bool(built) is builds
    assert (reason is None) is builds, reason


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
