"""The README's layout table names every package and top-level module of ``sglang_cpkv`` (a newcomer's map of the
code must not leave a part out)."""

import re
import sys
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="cpkv-cpu")

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "python" / "sglang_cpkv"


def _layout_table() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## Layout", 1)[1].split("\n## ", 1)[0]


def test_every_package_and_module_is_in_the_layout_table():
    table = _layout_table()
    parts = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")
    )
    assert len(parts) > 10
    missing = [name for name in parts if not re.search(rf"[`/]{re.escape(name)}[`/]", table)]
    assert missing == [], f"README's layout table leaves out {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
