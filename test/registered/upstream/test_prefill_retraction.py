"""What retraction is on a P/D prefill server of the pinned upstream (the compatibility table's retraction row).

Upstream retracts decode batches in ``Scheduler.update_running_batch`` (``ScheduleBatch.retract_decode``). The
prefill server's event loops never call it: they schedule prefill batches only, and its retractions are the
optimistic-prefill requeue and ``pause_generation(mode="retract")``, which free a request's pages and prefill it
again (what the mode sees is pages freed and reused, and a radix hit: the row's other tests). A release whose
prefill loop starts retracting decode batches fails here, and the row must be looked at again.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="cpkv-cpu")

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

DECODE_RETRACTION = {"update_running_batch", "retract_decode"}


def _module(name: str) -> ast.Module:
    """The installed upstream module's source, parsed (not imported)."""
    return ast.parse(Path(importlib.util.find_spec(name).origin).read_text())


def _function(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef:
    owner = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(tree: ast.AST) -> set[str]:
    """Names of the methods and functions called in ``tree`` (its own code, not what they call)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def test_a_prefill_server_retracts_no_decode_batch():
    prefill = _module("sglang.srt.disaggregation.prefill")
    assert not _calls(prefill) & DECODE_RETRACTION, _calls(prefill) & DECODE_RETRACTION
    for loop in ("event_loop_normal_disagg_prefill", "event_loop_overlap_disagg_prefill"):
        calls = _calls(_function(prefill, "SchedulerDisaggregationPrefillMixin", loop))
        assert "get_next_disagg_prefill_batch_to_run" in calls, loop  # the loop this test reads is the one that runs
        assert not calls & DECODE_RETRACTION, (loop, calls & DECODE_RETRACTION)


def test_the_decode_retraction_is_where_this_test_looks_for_it():
    """The test above can fail: upstream's decode retraction is a call of these names (in the scheduler)."""
    scheduler = _module("sglang.srt.managers.scheduler")
    assert "retract_decode" in _calls(_function(scheduler, "Scheduler", "update_running_batch"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
