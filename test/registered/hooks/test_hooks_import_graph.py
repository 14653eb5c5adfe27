"""The package's imports point one way.

* No module of ``sglang_cpkv`` imports itself back, through any chain: every import of another ``sglang_cpkv`` module,
  at module level or inside a function, is an edge here (``from pkg import mod`` counts ``pkg`` and ``pkg.mod``; a
  package's ``__init__`` importing its submodules counts too), and the graph must have no cycle. Circles this removed:
  the DSA hooks <-> ``exchange_group`` <-> ``reservation`` (the settings now live in ``hooks/settings.py``),
  ``testing/batches`` <-> ``testing/value_keyed_inverse`` (the negative control's check lives with it), and
  ``harness/__init__`` <-> ``harness/cli`` (the command is ``harness.cli.main``).
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
PACKAGE = "sglang_cpkv"
HOOKS = f"{PACKAGE}.hooks"
TEST_SUPPORT = ("sglang_cpkv.testing", "sglang_cpkv.harness", "sglang_cpkv.soak")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCES).with_suffix("").parts
    return ".".join((PACKAGE, *parts)).removesuffix(".__init__")


def _imports(source: str, module: str = "", is_package: bool = False) -> set[str]:
    """Every module name ``source`` (the text of ``module``) imports anywhere in its body (``from pkg import mod``
    counts ``pkg`` and ``pkg.mod``; a relative import is resolved against ``module``)."""
    found = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module
            found |= {name} | {f"{name}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _graph(under: str = PACKAGE) -> dict[str, set[str]]:
    """The import graph of the package's modules under ``under`` (an edge: a module imports another of them)."""
    files = {_module_name(p): p for p in SOURCES.rglob("*.py")}
    files = {name: path for name, path in files.items() if name == under or name.startswith(under + ".")}
    names = set(files)
    return {
        name: (_imports(path.read_text(), name, path.name == "__init__.py") & names) - {name}
        for name, path in files.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    cycles = _cycles(graph)
    return cycles[0] if cycles else None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk of ``graph`` meets, each sharing no module with one named before (empty: the
    graph has no circle)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    found: list[list[str]] = []
    seen: set[str] = set()

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                if not seen & set(cycle):
                    found.append(cycle)
                seen.update(cycle)
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_graph_sees_the_imports():
    graph = _graph()
    assert len(graph) > 100
    assert f"{HOOKS}.settings" in graph[f"{HOOKS}.dsa_metadata"]
    assert f"{HOOKS}.state" in graph[f"{HOOKS}.dsa_metadata"]
    assert f"{HOOKS}.dsa_batch" in graph[f"{HOOKS}.dsa_latent"] & graph[f"{HOOKS}.dsa_index_k"]
    # a package's __init__ importing its submodules; an import inside a function
    assert {f"{PACKAGE}.runtime.plan", f"{PACKAGE}.runtime.pipeline"} <= graph[f"{PACKAGE}.runtime"]
    assert f"{PACKAGE}.capacity.upstream" in graph[f"{PACKAGE}.testing.pool_sizing"]
    assert _graph(HOOKS).keys() == {name for name in graph if name == HOOKS or name.startswith(HOOKS + ".")}


def test_no_module_imports_itself_back():
    cycles = _cycles(_graph())
    assert not cycles, "import circles:\n  " + "\n  ".join(" -> ".join(cycle) for cycle in cycles)


def test_no_hook_module_imports_itself_back():
    cycle = _cycle(_graph(HOOKS))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_a_circle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    two = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"d", "c"}}
    assert _cycles(two) == [["a", "b", "a"], ["d", "e", "d"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_imports_of_a_module_are_found():
    source = (
        "import sglang_cpkv.runtime.checked as checked\n"
        "from sglang_cpkv.testing import batches\n"
        "def f():\n"
        "    from . import lockstep\n"
        "    from ..ops.errors import CpSharedKvError\n"
    )
    assert _imports(source, f"{PACKAGE}.testing.demo") == {
        "sglang_cpkv.runtime.checked",
        "sglang_cpkv.testing",
        "sglang_cpkv.testing.batches",
        "sglang_cpkv.testing.lockstep",
        "sglang_cpkv.ops.errors",
        "sglang_cpkv.ops.errors.CpSharedKvError",
    }
    assert _imports("from .cli import main\n", f"{PACKAGE}.harness", is_package=True) == {
        "sglang_cpkv.harness.cli",
        "sglang_cpkv.harness.cli.main",
    }


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
