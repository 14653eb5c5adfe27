"""Tests that publish upstream's server args, scoped: each test leaves upstream's process-wide context as it found it.

Upstream keeps one runtime context per process (``sglang.srt.runtime_context``: the published ``ServerArgs``, its
config bags, parallel overrides and stamps). A test that publishes a TP 8 prefill server and never resets it breaks
a later test of the same process that builds a CP 2 world ("parallel topology is inconsistent"). Import
:func:`scoped_upstream_context` into a test module that publishes server args (it is autouse): every test of the
module runs inside :func:`sglang_cpkv.capacity.upstream.scoped_runtime_context`, with the mode's process state
(``hooks/state.py``: its configuration, exchange group and allocator record) put back too. The sizing itself is :mod:`sglang_cpkv.capacity.upstream`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def scoped_upstream_context():
    from sglang_cpkv.capacity.upstream import scoped_runtime_context
    from sglang_cpkv.hooks import state

    with scoped_runtime_context(), state.scoped(empty=False):
        yield
