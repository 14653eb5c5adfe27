"""Upstream sglang in the tests: the mode's flag on the published args, and upstream-backed tests that must run.

(Importing upstream's modules without torchvision: :mod:`sglang_cpkv.upstream_import`, which tests install first.)

Upstream-backed tests skip, saying why, where upstream cannot be imported (a bare GPU box, say). In the
GPU test environment (``scripts/gpu_env/install.sh``), which exports ``SGLANG_CPKV_REQUIRE_UPSTREAM=1``,
such a test must run: :func:`skip_or_fail` turns the skip into a failure there, and :func:`kit_testcase`
gives upstream's test kits (which call ``testcase.skipTest``) a test case that does the same.

Only tests use this module; it never imports sglang itself.
"""

from __future__ import annotations

import unittest
from typing import NoReturn

from sglang_cpkv.envs import envs

REQUIRE_UPSTREAM_ENV = envs.SGLANG_CPKV_REQUIRE_UPSTREAM.name


def set_cp_shared_kv_flag(on: bool) -> None:
    """Set ``--enable-cp-shared-kv`` on the server args published in this process (what the hooks read).

    Tests of the hooks at cp = 1 need the flag where a real server would refuse it (start-up validation
    asks for prefill CP), so it is written onto the published record directly, past its strict setter.
    """
    import msgspec
    from sglang.srt.runtime_context import get_server_args

    msgspec.Struct.__setattr__(get_server_args(), "enable_cp_shared_kv", on)


def upstream_required() -> bool:
    """Whether upstream-backed tests must run here (``SGLANG_CPKV_REQUIRE_UPSTREAM``, set by the GPU test env)."""
    return envs.SGLANG_CPKV_REQUIRE_UPSTREAM.get()


def skip_or_fail(reason: str) -> NoReturn:
    """Skip an upstream-backed test for ``reason``; fail it instead where upstream is required."""
    import pytest

    if upstream_required():
        pytest.fail(
            f"{reason} [{REQUIRE_UPSTREAM_ENV}=1: in the GPU test environment (scripts/gpu_env/install.sh) an "
            "upstream-backed test that cannot run is a failure, not a skip]",
            pytrace=False,
        )
    pytest.skip(reason)


class _KitTestCase(unittest.TestCase):
    """The ``testcase`` upstream's kits take: unittest assertions, and ``skipTest`` through :func:`skip_or_fail`."""

    def runTest(self) -> None:  # unittest needs a method to bind; the kit calls the assertions directly
        pass

    def skipTest(self, reason) -> NoReturn:
        skip_or_fail(f"upstream's kit skipped: {reason}")


def kit_testcase() -> unittest.TestCase:
    """A test case for ``sglang.test.kits`` helpers (``run_dsa_sparse_attention_case(testcase, ...)``)."""
    return _KitTestCase()
