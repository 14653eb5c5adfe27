"""The distribution's environment switches, read one way (:mod:`sglang_cpkv.env`): a boolean switch refuses a
value it does not know, naming the variable; a scoped environment puts back exactly what it found."""

import os
import sys

import pytest

from sglang_cpkv.env import env_flag, environment
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="cpkv-cpu")

NAME = "SGLANG_CPKV_TEST_SWITCH"


@pytest.mark.parametrize(
    "value, default, expected",
    [(None, False, False), ("", True, True), ("1", False, True), ("On", False, True), ("no", True, False)],
)
def test_a_switch_reads_its_spellings_and_default(monkeypatch, value, default, expected):
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, default) is expected


def test_an_unknown_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(NAME, "maybe")
    with pytest.raises(ValueError, match=f"{NAME}='maybe'"):
        env_flag(NAME)


def test_a_scoped_environment_puts_back_set_and_unset_names(monkeypatch):
    monkeypatch.setenv(NAME, "before")
    monkeypatch.delenv(NAME + "_NEW", raising=False)
    monkeypatch.delenv(NAME + "_KEPT", raising=False)
    with pytest.raises(RuntimeError), environment({NAME: "inside", NAME + "_NEW": "1"}, keep=(NAME + "_KEPT",)):
        assert os.environ[NAME] == "inside" and os.environ[NAME + "_NEW"] == "1"
        os.environ[NAME + "_KEPT"] = "set by the block"
        raise RuntimeError("the block fails")
    assert os.environ[NAME] == "before"
    assert NAME + "_NEW" not in os.environ and NAME + "_KEPT" not in os.environ


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
