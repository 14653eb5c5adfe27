"""Secrets, wheels, environments, caches and logs stay out of the image and out of git.

The image's build context is the repository root (``docker build -f docker/Dockerfile .``) and ``COPY``
bakes what it copies into a layer: the operator's ``docker/.env`` (where ``HF_TOKEN`` goes), the GPU
wheels of ``.whl/``, a virtual environment or a log directory inside the tree must be excluded by the
root ``.dockerignore`` (read by the classic builder and BuildKit alike) and ignored by git. Checked here
with Docker's own rules for the context (paths relative to the context root, ``**`` for any depth, a
pattern that matches a directory excludes what is under it, ``!`` re-includes) and ``git check-ignore``.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sglang_cpkv.pd_launch import PDConfig
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "docker"
LOG_MOUNT = "/var/log/sglang-cpkv"
# Where a log lands when an operator points the compose volume or PD_LOG_DIR at the tree the way the
# documented commands (docs/operations.md) run (from the repository root; compose resolves relative paths from docker/).
IN_TREE_LOG_DIRS = ["pd-logs", "docker/pd-logs"]


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def excluded_from_context(relpath: str) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; a matched parent excludes its children."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    parts = relpath.strip("/").split("/")
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch("/".join(parts[: n + 1])) for n in range(len(parts))):
            excluded = not negate
    return excluded


def compose_log_host_dir() -> Path:
    """The host directory of the compose log volume with no overrides, resolved the way compose resolves it."""
    node = yaml.safe_load((DOCKER / "compose.pd.yaml").read_text())["x-pd-node"]
    (volume,) = [v for v in node["volumes"] if v.endswith(":" + LOG_MOUNT)]
    host = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", volume.rsplit(":", 1)[0])
    return (DOCKER / os.path.expanduser(host)).resolve()


def test_ignore_rules_behave_like_dockers():
    # The matcher itself: root-anchored plain names, ** at any depth, children of an excluded directory.
    assert excluded_from_context(".git/config") and excluded_from_context("python/x.egg-info/PKG-INFO")
    assert excluded_from_context("a/b/__pycache__/m.pyc") and not excluded_from_context("python/sglang_cpkv/env.py")
    assert excluded_from_context(".venv/bin/python") and not excluded_from_context("python/sglang_cpkv/logs.py")
    assert not excluded_from_context("python/sglang_cpkv/pd_launch/config.py")


def test_no_dockerfile_specific_ignore_file_shadows_the_root_one():
    # BuildKit prefers docker/Dockerfile.dockerignore over the root file when it exists: one file, one rule set.
    assert not (DOCKER / "Dockerfile.dockerignore").exists()


# What must never reach the image: (path, whether git must ignore it too; tracked benchmark logs are git's business).
KEPT_OUT = [
    ("docker/.env", True),
    (".env", True),
    ("scripts/pd/.env.local", True),
    (".whl/torch-2.14.1-cp311-cp311-linux_x86_64.whl", True),
    ("dist/sglang_cpkv-0.1.0-py3-none-any.whl", True),
    (".venv/bin/python", True),
    ("python/.venv/bin/python", True),
    (".cache/sglang_cpkv/cuda/lib.so", True),
    ("python/sglang_cpkv/__pycache__/env.cpython-311.pyc", True),
    (".pytest_cache/v/cache/lastfailed", True),
    ("certs/server.key", True),
    ("pd-logs/prefill.pid", True),
    ("benchmark/results/x/bench.log", False),
]


@pytest.mark.parametrize("path, git_ignores", KEPT_OUT, ids=[p for p, _ in KEPT_OUT])
def test_secrets_wheels_envs_caches_and_logs_are_kept_out(path, git_ignores):
    assert excluded_from_context(path), f"{path} would be copied into the image"
    if git_ignores:
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, timeout=30)
        assert ignored.returncode == 0, f"{path} is not ignored by git"


def test_what_the_image_needs_is_in_the_context():
    for path in (
        "UPSTREAM.toml",
        "patches/series",
        "docker/install.sh",
        "scripts/pd/pd.sh",
        "scripts/pd/glm51-fp8-b300.env",
    ):
        assert not excluded_from_context(path), path


def test_compose_logs_are_outside_the_build_context_or_excluded():
    host_dir = compose_log_host_dir()
    inside = host_dir.is_relative_to(REPO)
    assert not inside or excluded_from_context(str(host_dir.relative_to(REPO)) + "/prefill.log"), host_dir


def test_launcher_default_log_dir_is_outside_the_tree():
    log_dir = PDConfig.from_env({}).log_dir
    assert log_dir.is_absolute() and not log_dir.resolve().is_relative_to(REPO)


@pytest.mark.parametrize("log_dir", IN_TREE_LOG_DIRS)
def test_in_tree_log_dirs_are_excluded_from_the_image_and_ignored_by_git(log_dir):
    log = f"{log_dir}/prefill-20261201-000000-1.log"
    assert excluded_from_context(log), f"{log} would be copied into the image"
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", log], cwd=REPO, timeout=30)
    assert ignored.returncode == 0, f"{log} is not ignored by git"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
