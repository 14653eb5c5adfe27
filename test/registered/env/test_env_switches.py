"""The distribution's environment variables, read one way (:mod:`sglang_cpkv.envs`): a boolean refuses a value it does
not know, naming the variable; unset and empty read as the default; an old name still reads, and disagreeing with the
new one is an error; ``override`` and a scoped environment (:func:`sglang_cpkv.envs.environment`) put back exactly what
they found."""

import os
import sys

import pytest

from sglang_cpkv.envs import SERVING, EnvBool, EnvInt, EnvStr, environment, envs
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="cpkv-cpu")

NAME = "SGLANG_CPKV_TEST_SWITCH"


class _Fields:
    SGLANG_CPKV_TEST_SWITCH = EnvBool(False, "a test switch", scope=SERVING)
    SGLANG_CPKV_TEST_DEFAULT_ON = EnvBool(True, "a test switch, on by default", scope=SERVING)
    SGLANG_CPKV_TEST_COUNT = EnvInt(3, "a test number", scope=SERVING)
    SGLANG_CPKV_TEST_NEW = EnvStr("fallback", "a renamed test text", scope=SERVING, aliases=("SGLANG_CPKV_TEST_OLD",))


@pytest.mark.parametrize(
    "field, value, expected",
    [
        (_Fields.SGLANG_CPKV_TEST_SWITCH, None, False),
        (_Fields.SGLANG_CPKV_TEST_DEFAULT_ON, None, True),
        (_Fields.SGLANG_CPKV_TEST_DEFAULT_ON, "", True),
        (_Fields.SGLANG_CPKV_TEST_DEFAULT_ON, "  ", True),
        (_Fields.SGLANG_CPKV_TEST_SWITCH, "1", True),
        (_Fields.SGLANG_CPKV_TEST_SWITCH, "true", True),
        (_Fields.SGLANG_CPKV_TEST_SWITCH, "On", True),
        (_Fields.SGLANG_CPKV_TEST_SWITCH, " YES ", True),
        (_Fields.SGLANG_CPKV_TEST_DEFAULT_ON, "no", False),
        (_Fields.SGLANG_CPKV_TEST_DEFAULT_ON, "OFF", False),
        (_Fields.SGLANG_CPKV_TEST_DEFAULT_ON, "0", False),
        (_Fields.SGLANG_CPKV_TEST_COUNT, None, 3),
        (_Fields.SGLANG_CPKV_TEST_COUNT, "12", 12),
    ],
)
def test_a_field_reads_its_spellings_and_default(monkeypatch, field, value, expected):
    if value is None:
        monkeypatch.delenv(field.name, raising=False)
    else:
        monkeypatch.setenv(field.name, value)
    assert field.get() == expected and type(field.get()) is type(expected)
    assert field.is_set() is bool(value)


@pytest.mark.parametrize(
    "field, value", [(_Fields.SGLANG_CPKV_TEST_SWITCH, "maybe"), (_Fields.SGLANG_CPKV_TEST_COUNT, "x")]
)
def test_an_unknown_value_is_an_error_naming_the_variable(monkeypatch, field, value):
    monkeypatch.setenv(field.name, value)
    with pytest.raises(ValueError, match=f"{field.name}='{value}'"):
        field.get()


def test_a_field_reads_a_given_mapping_instead_of_the_environment(monkeypatch):
    monkeypatch.setenv(NAME, "1")
    assert _Fields.SGLANG_CPKV_TEST_SWITCH.get({}) is False
    assert _Fields.SGLANG_CPKV_TEST_SWITCH.get({NAME: "off"}) is False
    assert _Fields.SGLANG_CPKV_TEST_SWITCH.text({NAME: ""}) == ""


def test_an_old_name_still_reads_and_disagreeing_names_are_an_error(monkeypatch):
    field = _Fields.SGLANG_CPKV_TEST_NEW
    for name in field.names:
        monkeypatch.delenv(name, raising=False)
    assert field.get() == "fallback"
    monkeypatch.setenv("SGLANG_CPKV_TEST_OLD", "old")
    assert field.get() == "old" and field.lookup() == ("SGLANG_CPKV_TEST_OLD", "old")
    monkeypatch.setenv("SGLANG_CPKV_TEST_NEW", "old")
    assert field.get() == "old"
    monkeypatch.setenv("SGLANG_CPKV_TEST_NEW", "new")
    with pytest.raises(ValueError, match="SGLANG_CPKV_TEST_NEW='new' and SGLANG_CPKV_TEST_OLD='old' disagree"):
        field.get()


@pytest.mark.parametrize("name", ["SGLANG_CPKV_DRAFT_SHARED_KV", "SGLANG_CP_DRAFT_SHARED_KV"])
def test_the_draft_setting_reads_under_its_name_and_its_old_name(monkeypatch, name):
    from sglang_cpkv.hooks.settings import draft_extends_under_cp

    for each in envs.SGLANG_CPKV_DRAFT_SHARED_KV.names:
        monkeypatch.delenv(each, raising=False)
    assert not draft_extends_under_cp()
    monkeypatch.setenv(name, "1")
    assert draft_extends_under_cp()
    monkeypatch.setenv(name, "0")
    assert not draft_extends_under_cp()


def test_override_puts_back_the_name_and_its_old_names(monkeypatch):
    field = _Fields.SGLANG_CPKV_TEST_NEW
    monkeypatch.setenv("SGLANG_CPKV_TEST_OLD", "old")
    monkeypatch.delenv("SGLANG_CPKV_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), field.override("inside"):
        assert field.get() == "inside" and "SGLANG_CPKV_TEST_OLD" not in os.environ
        raise RuntimeError("the block fails")
    assert os.environ["SGLANG_CPKV_TEST_OLD"] == "old" and "SGLANG_CPKV_TEST_NEW" not in os.environ
    with _Fields.SGLANG_CPKV_TEST_DEFAULT_ON.override(False):
        assert os.environ["SGLANG_CPKV_TEST_DEFAULT_ON"] == "0" and not _Fields.SGLANG_CPKV_TEST_DEFAULT_ON.get()
    with field.override(None):
        assert field.get() == "fallback"
    assert os.environ["SGLANG_CPKV_TEST_OLD"] == "old"


def test_a_field_is_not_its_value():
    with pytest.raises(TypeError, match=r"envs\.SGLANG_CPKV_CHECKED\.get\(\)"):
        bool(envs.SGLANG_CPKV_CHECKED)


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
