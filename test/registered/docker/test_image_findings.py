"""What an operator hit with the image on a real engine (issue 54), checked without one.

Each finding has its check here where a file can show it: the Dockerfile (its instructions, read as the builder
reads them), docker/build.sh (run for real, with a stand-in ``docker`` on PATH that records its arguments), the entry
point (run for real on this machine, as the uid a container runs as) and the documented commands (docs/operations.md).
``make image-test`` (docker/test/image_test.py) runs the same findings in containers of a built image.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "docker"
NOBODY = 65534


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def index_of(predicate) -> int:
    return next(i for i, instruction in enumerate(instructions()) if predicate(*instruction))


def test_the_base_images_label_sees_the_base_argument():
    # An ARG declared before FROM is empty after it unless declared again: the label was "".
    steps = instructions()
    after_from = steps[index_of(lambda op, _: op == "FROM") + 1 :]
    declared = {args.split("=")[0] for op, args in after_from if op == "ARG"}
    assert {"BASE_IMAGE", "BASE_IMAGE_DIGEST"} <= declared
    labels = " ".join(args for op, args in steps if op == "LABEL")
    assert 'org.opencontainers.image.base.name="${BASE_IMAGE}${BASE_IMAGE_DIGEST}"' in labels


def test_the_revision_and_source_come_after_every_build_step():
    # Declared before the CUDA build, a new commit's revision invalidated it (and every layer after it).
    steps = instructions()
    first = min(
        i for i, (op, args) in enumerate(steps) if op == "ARG" and args.startswith(("CPKV_REVISION", "CPKV_SOURCE"))
    )
    later = [op for op, args in steps[first:] if op in ("RUN", "COPY")]
    assert later == ["RUN"]  # the credentials check alone
    assert "CPKV_SOURCE" in steps[first:][[op for op, _ in steps[first:]].index("RUN")][1]


def test_the_copied_tree_is_made_readable_whatever_the_checkouts_umask():
    # Under umask 027 the COPYs kept mode 0750: uid 10001 could not exec the entry point (exit 126).
    steps = instructions()
    for i, (op, args) in enumerate(steps):
        if op == "COPY":
            use = next(j for j in range(i + 1, len(steps)) if steps[j][0] == "RUN")
            assert "chmod -R u+rwX,go+rX,go-w /opt/sglang-cpkv" in steps[use][1], (args, steps[use][1])


def test_an_image_without_the_cuda_build_is_a_build_argument():
    steps = instructions()
    assert ("ARG", "CPKV_KERNELS=1") in steps
    (build,) = [args for op, args in steps if op == "RUN" and "docker/install.sh" in args]
    assert "0) set -- --no-kernels" in build and "exit 2" in build


@pytest.fixture()
def recorded_build(tmp_path):
    """docker/build.sh in a clone whose origin URL carries a token, with a `docker` that records its arguments."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(clone)], check=True)
    (clone / "docker").mkdir()
    shutil.copy(DOCKER / "build.sh", clone / "docker" / "build.sh")
    subprocess.run(
        ["git", "-C", str(clone), "remote", "add", "origin", "https://x-access-token:ghs_SECRET123@github.com/o/r.git"],
        check=True,
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\n')
    (bin_dir / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("BASE_IMAGE", None)

    def build(*args: str) -> list[str]:
        subprocess.run([clone / "docker" / "build.sh", *args], check=True, env=env, capture_output=True, timeout=60)
        return (tmp_path / "argv").read_text().splitlines()

    return build


def test_make_image_labels_the_clone_url_without_its_credentials(recorded_build):
    argv = recorded_build()
    assert "CPKV_SOURCE=https://github.com/o/r.git" in argv
    assert not any("SECRET123" in a or "x-access-token" in a for a in argv)
    assert argv[:3] == ["build", "--network", "none"] and "CPKV_KERNELS=1" in argv


def test_make_image_builds_without_the_cuda_ops_when_asked(recorded_build):
    assert "CPKV_KERNELS=0" in recorded_build("--no-kernels")


def run_entrypoint(*args: str, uid: int = NOBODY, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(DOCKER / "entrypoint.sh"), *args]
    if os.getuid() == 0 and uid != 0:
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="runs the entry point as another uid (CI runs as root)")


@pytest.fixture()
def open_dir():
    """A directory every uid can traverse (pytest's own are root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="cpkv-image-findings-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@needs_root
def test_a_role_names_every_directory_it_cannot_write_before_it_starts(open_dir):
    # --read-only failed at once on /tmp/sglang-cpkv.role, saying nothing of what the image needs writable.
    locked = open_dir / "locked"
    locked.mkdir(mode=0o755)
    out = run_entrypoint("prefill", env={"TMPDIR": str(locked), "PD_LOG_DIR": str(locked), "HOME": str(locked)})
    assert out.returncode == 78, out.stderr
    for directory in (str(locked), f"{locked}/.cache"):
        assert directory in out.stderr
    assert "--tmpfs /tmp" in out.stderr and not (locked / "sglang-cpkv.role").exists()


@needs_root
def test_prepare_dirs_gives_a_fresh_mount_to_the_user_and_refuses_an_operators_directory(open_dir):
    fresh, held, own = open_dir / "fresh", open_dir / "held", open_dir / "own"
    for directory in (fresh, held, own):
        directory.mkdir(mode=0o755)
    (held / "model.safetensors").write_text("x")
    os.chown(own, 4242, 4242)
    out = run_entrypoint("prepare-dirs", str(fresh), str(own), uid=0, env={"CPKV_USER": "4242:4242"})
    assert out.returncode == 0, out.stderr
    assert (fresh.stat().st_uid, own.stat().st_uid) == (4242, 4242)
    refused = run_entrypoint("prepare-dirs", str(held), uid=0, env={"CPKV_USER": "4242"})
    assert refused.returncode == 78 and str(held) in refused.stderr and held.stat().st_uid == 0


def test_compose_prepares_the_host_directories_before_the_roles():
    # On a fresh host Docker created them root's, and every role looped on "PD_LOG_DIR ... is not writable".
    spec = yaml.safe_load((DOCKER / "compose.pd.yaml").read_text())
    prepare = spec["services"]["prepare"]
    assert prepare["user"] == "0:0" and prepare["command"][0] == "prepare-dirs"
    assert sorted(v.rsplit(":", 1)[1] for v in prepare["volumes"]) == sorted(prepare["command"][1:])
    for role in ("prefill", "decode"):
        assert spec["services"][role]["depends_on"]["prepare"] == {"condition": "service_completed_successfully"}
        assert spec["services"][role]["volumes"] == prepare["volumes"]


def test_the_documented_validate_line_runs_as_the_operator():
    # As uid 10001 it could not write the operator's own `mkdir -p`'d log directory: exit 5 "not writable".
    readme = (REPO / "docs" / "operations.md").read_text()
    (line,) = [
        line
        for line in readme.splitlines()
        if line.startswith("docker run") and "validate" in readme.split(line)[1][:120]
    ]
    assert '--user "$(id -u):$(id -g)"' in line, line


def test_the_docs_say_how_to_build_and_test_the_image():
    readme = (REPO / "docs" / "operations.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert "make image" in readme and "make image-test" in readme and "make-standin-base.sh" in readme
    assert re.search(r"^image:\n\tdocker/build\.sh", makefile, re.M) and "docker/test/image_test.py" in makefile
    assert "--read-only" in readme and "--tmpfs /tmp" in readme


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
