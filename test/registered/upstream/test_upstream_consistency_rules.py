"""Upstream's own CPU consistency rules hold on the patched tree (issue 53 item 3).

Upstream's test files are not in the wheel, so their rules are mirrored here over the installed (patched) tree:

* ``test/registered/unit/server_args/test_resolution_hook_registry.py::TestWhitelistMatchesThePipeline``: the first
  argument of every ``run_hook(...)`` call in ``srt/arg_groups/pipeline.py`` (read statically, ``ast``) is exactly
  ``srt/arg_groups/resolution_hooks._OVERRIDABLE_HOOKS``;
* ``test/registered/unit/server_args/test_server_args_docs_coverage.py``: every live ``ServerArgs`` flag (the real
  argparse surface, ``ServerArgs.add_cli_args``, any alias counting) has a row whose first ``<td>`` names it in
  backticks or ``<code>``, every flag a cell names still registers (live or deprecated), every row has four cells.
  Upstream's rows are upstream's page; the flags the queue adds (the patched tree's live flags less the pristine
  tree's) are documented in ``docs/server-arguments.md`` in the same markup.

Each rule is also run on the pristine tree (``testing/upstream_trees.pristine_tree``), where upstream's own test passes:
the mirror reads what upstream's test reads.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.upstream_trees import pristine_tree

register_cpu_ci(est_time=60, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "server-arguments.md"
QUEUE_FLAGS = {"--enable-cp-shared-kv", "--cp-shared-kv-max-batch-tokens"}
# upstream's regexes (test_server_args_docs_coverage.py)
ROW_FLAG_RE = re.compile(r"`(--[a-zA-Z0-9][\w-]*)`|<code>(--[a-zA-Z0-9][\w-]*)</code>")
DOC_COLUMNS = 4

# Run in a subprocess over one tree: the run_hook targets of its pipeline.py, its _OVERRIDABLE_HOOKS, and its argparse
# surface ({option: [all option strings of the action, deprecated?]}).
_PROBE = r"""
import argparse, ast, json
from sglang_cpkv.upstream_import import install_torchvision_stub
install_torchvision_stub()
from sglang.srt.arg_groups import pipeline, resolution_hooks
from sglang.srt.arg_groups.argparse_actions import (
    DeprecatedAction, DeprecatedAliasStoreAction, DeprecatedStoreConstAction, DeprecatedStoreTrueAction)
from sglang.srt.server_args import ServerArgs
tree = ast.parse(open(pipeline.__file__).read())
called = sorted({
    n.args[0].id for n in ast.walk(tree)
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "run_hook"
    and n.args and isinstance(n.args[0], ast.Name)})
parser = argparse.ArgumentParser(add_help=False)
ServerArgs.add_cli_args(parser)
deprecated = (DeprecatedAction, DeprecatedStoreTrueAction, DeprecatedStoreConstAction, DeprecatedAliasStoreAction)
actions = [[a.option_strings, isinstance(a, deprecated)] for a in parser._actions if a.option_strings]
print(json.dumps({"file": pipeline.__file__, "called": called,
                  "whitelist": sorted(resolution_hooks._OVERRIDABLE_HOOKS), "actions": actions}))
"""


def _probe(tree: Path | None) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    pristine = pristine_tree(tmp_path_factory.mktemp("pristine"))
    result = {"patched": _probe(None), "pristine": _probe(pristine)}
    assert result["pristine"]["file"].startswith(str(pristine)), "the pristine probe imported another tree"
    return result


@pytest.mark.parametrize("which", ["pristine", "patched"])
def test_every_whitelisted_hook_has_a_call_site(trees, which):
    called, whitelist = set(trees[which]["called"]), set(trees[which]["whitelist"])
    assert (sorted(whitelist - called), sorted(called - whitelist)) == ([], []), (
        f"{which}: (whitelisted but never called, called but not whitelisted) -- both should be empty"
    )


def _rows(text: str) -> list[list[str]]:
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", text, re.S)]
    return [cells for cells in rows if cells]  # header rows hold only <th> cells


def _flags_in(cells) -> set[str]:
    return {m.group(1) or m.group(2) for cell in cells for m in ROW_FLAG_RE.finditer(cell)}


def test_every_flag_the_queue_adds_has_a_row(trees):
    def live(which):
        return {tuple(options) for options, deprecated in trees[which]["actions"] if not deprecated}

    added = live("patched") - live("pristine")
    assert {options[0] for options in added} == QUEUE_FLAGS, "the queue's flags changed: document the new one here"
    rows = _rows(DOC.read_text(encoding="utf-8-sig"))
    assert [cells[0][:80] for cells in rows if len(cells) != DOC_COLUMNS] == []
    first_cells = _flags_in(cells[0] for cells in rows)
    assert sorted(options[0] for options in added if first_cells.isdisjoint(options)) == []
    registered = {o for options, _ in trees["patched"]["actions"] for o in options}
    assert sorted(_flags_in(cell for cells in rows for cell in cells) - registered) == [], "stale rows"
    # Our page documents our flags only (upstream's rows are upstream's page).
    assert first_cells <= {o for options in added for o in options}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
