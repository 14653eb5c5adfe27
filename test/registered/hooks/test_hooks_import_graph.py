"""The package's imports point one way.

* The hook modules import each other without a circle: the DSA hooks <-> ``exchange_group`` <-> ``reservation`` once
  imported each other for the mode's settings; every import of another hook module, at module level or inside a
  function, is an edge here, and the graph must have no cycle. The settings live in ``hooks/settings.py``.
* No product module imports test support (``sglang_cpkv.testing``, ``sglang_cpkv.harness``, ``sglang_cpkv.soak``: not in
  the wheel).
"""

import ast
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="cpkv-cpu")

SOURCES = Path(__file__).resolve().parents[3] / "python" / "sglang_cpkv"
HOOKS = SOURCES / "hooks"
PACKAGE = "sglang_cpkv.hooks"
TEST_SUPPORT = ("sglang_cpkv.testing", "sglang_cpkv.harness", "sglang_cpkv.soak")


def _module_name(path: Path) -> str:
    parts = path.relative_to(HOOKS).with_suffix("").parts
    return ".".join((PACKAGE, *parts)).removesuffix(".__init__")


def _imports(source: str) -> set[str]:
    """Every module name ``source`` imports anywhere in its body (``from pkg import mod`` counts ``pkg`` and
    ``pkg.mod``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in HOOKS.rglob("*.py")}
    names = set(files)
    return {name: (_imports(path.read_text()) & names) - {name} for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_the_imports():
    graph = _graph()
    assert f"{PACKAGE}.settings" in graph[f"{PACKAGE}.dsa_metadata"]
    assert f"{PACKAGE}.state" in graph[f"{PACKAGE}.dsa_metadata"]
    assert f"{PACKAGE}.dsa_batch" in graph[f"{PACKAGE}.dsa_latent"] & graph[f"{PACKAGE}.dsa_index_k"]


def test_no_hook_module_imports_itself_back():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_a_circle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _test_support_imports(source: str) -> set[str]:
    """The test-support modules ``source`` imports anywhere in its body."""
    return {name for name in _imports(source) if name.split(".")[:2] in (t.split(".") for t in TEST_SUPPORT)}


def test_no_product_module_imports_test_support():
    product = [
        p for p in SOURCES.rglob("*.py") if p.relative_to(SOURCES).parts[0] not in ("testing", "harness", "soak")
    ]
    assert len(product) > 50
    offenders = {str(p.relative_to(SOURCES)): sorted(_test_support_imports(p.read_text())) for p in product}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_a_test_support_import_is_found():
    source = "def f():\n    from sglang_cpkv.testing.batches import BatchCase\nimport sglang_cpkv.harness.engine\n"
    assert _test_support_imports(source) == {
        "sglang_cpkv.testing.batches",
        "sglang_cpkv.testing.batches.BatchCase",
        "sglang_cpkv.harness.engine",
    }
    assert _test_support_imports("from sglang_cpkv.runtime import plan\n") == set()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
