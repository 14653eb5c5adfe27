"""The GPU test environment, as far as a CPU machine can prove it (scripts/gpu_env/, TEST-ONLY).

* The ``sgl_kernel`` stand-in serves ``sgl_kernel`` and any ``sgl_kernel.*`` submodule for imports, and a
  placeholder that is called raises a clear error; it steps aside for a real ``sgl_kernel``; the ``.pth``
  file that install.sh writes activates it in a fresh interpreter whose ``PYTHONPATH`` names the target
  (through the target's ``sitecustomize.py``, which still runs the one it shadows).
* Under ``SGLANG_CPKV_REQUIRE_UPSTREAM=1`` an upstream-backed test that cannot run fails, else it skips; the
  upstream-backed CUDA tests use that helper.
* ``scripts/gpu_env/prepare_wheels.sh`` really downloads the pinned cp312 wheel (sha256 of UPSTREAM.toml) and
  the closure, and the result verifies; the closure agrees with upstream's own metadata and with itself;
  ``verify_wheels`` catches a missing, extra or altered wheel; install.sh refuses the wrong Python.
* Never in the image: ``docker/Dockerfile`` and ``docker/install.sh`` name none of it, and importing our
  package activates nothing.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from sglang_cpkv.testing import gpu_env, sgl_kernel_standin
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.upstream_env import REQUIRE_UPSTREAM_ENV, kit_testcase, skip_or_fail

register_cpu_ci(est_time=40, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "scripts" / "gpu_env"
PIN = tomllib.loads((REPO / "UPSTREAM.toml").read_text())


@pytest.fixture
def standin():
    assert not sgl_kernel_standin.is_active() and "sgl_kernel" not in sys.modules
    assert sgl_kernel_standin.install()
    yield sgl_kernel_standin
    sgl_kernel_standin.uninstall()
    assert not sgl_kernel_standin.is_active() and "sgl_kernel" not in sys.modules


# ---------------------------------------------------------------------------------- the stand-in


def test_standin_serves_sgl_kernel_and_any_submodule(standin):
    import sgl_kernel
    from sgl_kernel import merge_state_v2
    from sgl_kernel.foo.bar import baz
    from sgl_kernel.scalar_type import ScalarType

    assert sgl_kernel.__sglang_cpkv_standin__ and "stand-in" in sgl_kernel.__doc__
    assert sys.modules["sgl_kernel.foo.bar"].__name__ == "sgl_kernel.foo.bar"
    assert isinstance(baz, sgl_kernel_standin.Placeholder) and repr(baz).endswith("sgl_kernel.foo.bar.baz>")
    assert isinstance(ScalarType.uint4b8, sgl_kernel_standin.Placeholder)  # attribute chains resolve
    assert merge_state_v2 is sgl_kernel.merge_state_v2  # one object per name
    assert os.environ[sgl_kernel_standin.ENV_MARKER] == "1"
    with pytest.raises(AttributeError):
        sgl_kernel.__version__  # noqa: B018 - dunders are absent, so probes like hasattr(m, "__version__") are honest
    with pytest.raises(ModuleNotFoundError):
        import sgl_kernel_npu  # noqa: F401 - another package that merely starts with the name


def test_calling_a_placeholder_fails_loudly(standin):
    from sgl_kernel.foo.bar import baz

    with pytest.raises(sgl_kernel_standin.SglKernelStandinError) as exc:
        baz(1, x=2)
    message = str(exc.value)
    assert "sgl_kernel.foo.bar.baz(...) was called" in message
    assert "import-only TEST stand-in" in message and "scripts/gpu_env/install.sh" in message
    with pytest.raises(sgl_kernel_standin.SglKernelStandinError, match=r"sgl_kernel\.a\.b\(\.\.\.\)"):
        __import__("sgl_kernel").a.b()


def test_standin_steps_aside_for_a_real_sgl_kernel(tmp_path, monkeypatch):
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert not sgl_kernel_standin.install()
        import sgl_kernel

        assert sgl_kernel.REAL and not sgl_kernel_standin.is_active()
    finally:
        sys.modules.pop("sgl_kernel", None)


def _fresh_python(code: str, pythonpath: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", sgl_kernel_standin.ENV_MARKER)}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_pth_file_activates_the_standin_in_a_fresh_interpreter(tmp_path):
    target, other = tmp_path / "site", tmp_path / "other"
    target.mkdir()
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    env_file = gpu_env.activate(target, REPO)
    assert (target / gpu_env.PTH_FILE).is_file() and (target / gpu_env.MARKER_FILE).is_file()
    assert "TEST-ONLY" in (target / gpu_env.PTH_FILE).read_text()

    code = (
        "import os, sys, sgl_kernel; from sgl_kernel.x.y import z\n"
        "print(sgl_kernel.__sglang_cpkv_standin__, os.environ.get('SGLANG_CPKV_SGL_KERNEL_STANDIN'),"
        " os.environ.get('SHADOWED_SITECUSTOMIZE_RAN'))\n"
        "z()\n"
    )
    result = _fresh_python(code, [target, other], tmp_path)
    assert result.stdout.split() == ["True", "1", "1"], result.stdout + result.stderr
    assert result.returncode == 1 and "SglKernelStandinError: sgl_kernel.x.y.z(...) was called" in result.stderr

    text = env_file.read_text()
    assert f"export {REQUIRE_UPSTREAM_ENV}=1" in text and f"{target.resolve()}" in text
    without = _fresh_python("import sgl_kernel", [REPO / "python"], tmp_path)  # no target: no stand-in
    assert without.returncode == 1 and "No module named 'sgl_kernel'" in without.stderr


def test_importing_our_package_activates_nothing(tmp_path):
    code = (
        "import sys, sglang_cpkv, sglang_cpkv.testing.sgl_kernel_standin as s, sglang_cpkv.testing.gpu_env\n"
        "import sglang_cpkv.testing.upstream_env\n"
        "assert not s.is_active() and 'sgl_kernel' not in sys.modules\n"
    )
    result = _fresh_python(code, [REPO / "python"], tmp_path)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------- skip or fail


def test_skip_or_fail_skips_by_default_and_fails_where_upstream_is_required(monkeypatch):
    monkeypatch.delenv(REQUIRE_UPSTREAM_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no upstream here"):
        skip_or_fail("no upstream here")
    with pytest.raises(pytest.skip.Exception, match="kit skipped: flash_mla missing"):
        kit_testcase().skipTest("flash_mla missing")
    monkeypatch.setenv(REQUIRE_UPSTREAM_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=rf"no upstream here \[{REQUIRE_UPSTREAM_ENV}=1"):
        skip_or_fail("no upstream here")
    with pytest.raises(pytest.fail.Exception, match="kit skipped: flash_mla missing"):
        kit_testcase().skipTest("flash_mla missing")
    case = kit_testcase()
    case.assertFalse(False)
    with pytest.raises(AssertionError):
        case.assertFalse(True, "unittest assertions work")


UPSTREAM_IMPORTS = (
    "from sglang.",
    "import sglang\n",
    "sglang_cpkv.testing.dsa_kit",
    "sglang_cpkv.testing.upstream_env",
)
SKIP_CALL = re.compile(r"pytest\.skip\(\s*(f?\"[^\"]*\")")


def _cuda_upstream_tests() -> list[Path]:
    files = []
    for path in sorted((REPO / "test" / "registered").rglob("test_*.py")):
        text = path.read_text()
        if "\nregister_cuda_ci(" in text and any(marker in text for marker in UPSTREAM_IMPORTS):
            files.append(path)
    return files


def test_upstream_backed_cuda_tests_fail_instead_of_skipping():
    files = _cuda_upstream_tests()
    assert any(p.name == "test_cp_shared_kv_kit_cuda.py" for p in files), files
    for path in files:
        text = path.read_text()
        assert "skip_or_fail" in text, f"{path}: use upstream_env.skip_or_fail, not a bare skip"
        # A bare skip is only for a machine without a GPU; a missing upstream must go through
        # skip_or_fail so the GPU test environment fails instead of passing.
        for message in SKIP_CALL.findall(text):
            assert "CUDA device" in message, f"{path}: bare pytest.skip({message}) would pass the GPU test environment"


# ---------------------------------------------------------------------------------- the wheels


def test_closure_list_agrees_with_the_pin_and_the_scripts():
    closure = gpu_env.read_closure(REPO / gpu_env.CLOSURE_FILE)
    names = {e.name for e in closure}
    assert names and not names & {"sglang", "sglang-kernel", "sgl-kernel", "torch", "triton"}
    assert gpu_env.PY_TAG == "cp312" and gpu_env.PY_TAG in PIN["upstream"]["wheels"]
    prepare = (SCRIPTS / "prepare_wheels.sh").read_text()
    assert "py_tag=cp312" in prepare and "py_version=3.12" in prepare
    assert '--python-tag "$py_tag"' in prepare and "--require-hashes" in prepare and "--no-deps" in prepare
    assert "requirements/gpu-test-closure.txt" in prepare
    install = (SCRIPTS / "install.sh").read_text()
    assert '[ "$version" = 3.12 ]' in install and "--no-index --no-deps" in install
    for script in ("prepare_wheels.sh", "install.sh"):
        assert (SCRIPTS / script).read_text().splitlines()[1].startswith("# TEST-ONLY")
        assert "set -euo pipefail" in (SCRIPTS / script).read_text()
        assert os.access(SCRIPTS / script, os.X_OK)


def test_read_closure_refuses_loose_lines(tmp_path):
    bad = tmp_path / "closure.txt"
    bad.write_text("pydantic>=2\n")
    with pytest.raises(gpu_env.GpuEnvError, match="expected 'name==version --hash"):
        gpu_env.read_closure(bad)
    bad.write_text(f"a==1 --hash=sha256:{'0' * 64}\nA==2 --hash=sha256:{'1' * 64}\n")
    with pytest.raises(gpu_env.GpuEnvError, match="listed more than once: a"):
        gpu_env.read_closure(bad)


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("gpu_env") / "whl"
    result = subprocess.run(
        [SCRIPTS / "prepare_wheels.sh"],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, WHEEL_DIR=str(dest), PYTHON=sys.executable),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ready:" in result.stderr
    return dest


def test_prepared_wheels_verify_and_fit_the_carry_budget(wheel_dir):
    assert gpu_env.verify_wheels(REPO, wheel_dir) == []
    files = sorted(wheel_dir.glob("*.whl"))
    assert PIN["upstream"]["wheels"]["cp312"]["filename"] in {p.name for p in files}
    assert len(files) == len(gpu_env.read_closure(REPO / gpu_env.CLOSURE_FILE)) + 1
    assert sum(p.stat().st_size for p in files) < 58 * 2**20
    for path in files:  # cp312, abi3 (a CPython 3 minimum at or below 3.12) or pure wheels for manylinux x86_64
        python, abi, platform = path.name[: -len(".whl")].split("-")[-3:]
        abi3 = abi == "abi3" and python.startswith("cp3") and int(python[3:]) <= 12
        assert python in ("cp312", "py3", "py2.py3") or abi3, path.name
        assert platform == "any" or "x86_64" in platform, path.name


def _requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
    env |= {"platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    reqs = [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env | {"extra": ""})]


def test_closure_satisfies_upstream_metadata_and_itself(wheel_dir):
    closure = {e.name: e.version for e in gpu_env.read_closure(REPO / gpu_env.CLOSURE_FILE)}
    for wheel in sorted(wheel_dir.glob("*.whl")):
        for req in _requirements(wheel):
            name = gpu_env.normalize(req.name)
            if name in closure:
                assert req.specifier.contains(closure[name], prereleases=True), (
                    f"{wheel.name} needs {req}, the closure pins {name}=={closure[name]}"
                )


def test_unmet_requirements_names_what_is_missing_and_skips_what_stays_behind_on_purpose(tmp_path):
    closure = {e.name for e in gpu_env.read_closure(REPO / gpu_env.CLOSURE_FILE)}
    assert not gpu_env.NOT_CARRIED & closure
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(
            "demo-1.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\nRequires-Dist: jedi>=0.18\n"
            "Requires-Dist: no-such-package-cpkv>=1\nRequires-Dist: pytest<1\n"
            'Requires-Dist: colorama; sys_platform == "win32"\nRequires-Dist: rich; extra == "fancy"\n',
        )
    unmet = gpu_env.unmet_requirements(tmp_path)
    assert len(unmet) == 2, unmet
    assert "needs no-such-package-cpkv>=1, not installed" in unmet[0] and "needs pytest<1, found pytest" in unmet[1]


def test_verify_wheels_catches_missing_extra_and_altered_wheels(wheel_dir, tmp_path):
    copy = tmp_path / "whl"
    shutil.copytree(wheel_dir, copy)
    dill = next(copy.glob("dill-*.whl"))
    dill.unlink()
    extra = copy / "dill-0.3.0-py3-none-any.whl"
    extra.write_bytes(b"not a wheel")
    (copy / "six-1.0-py3-none-any.whl").write_bytes(b"")
    pinned = copy / PIN["upstream"]["wheels"]["cp312"]["filename"]
    data = pinned.read_bytes()
    pinned.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    problems = "\n".join(gpu_env.verify_wheels(REPO, copy))
    assert "dill-0.3.0-py3-none-any.whl: version 0.3.0, the closure pins" in problems
    assert "six-1.0-py3-none-any.whl: not in requirements/gpu-test-closure.txt" in problems
    assert f"{pinned.name}: sha256 " in problems and "differs from the pin" in problems
    dill_entry = next(e for e in gpu_env.read_closure(REPO / gpu_env.CLOSURE_FILE) if e.name == "dill")
    extra.unlink()
    assert f"missing dill=={dill_entry.version}" in "\n".join(gpu_env.verify_wheels(REPO, copy))
    assert gpu_env.verify_wheels(REPO, tmp_path / "absent")[0].endswith(
        "run scripts/gpu_env/prepare_wheels.sh on a CPU machine"
    )


def test_install_script_refuses_an_interpreter_that_is_not_cp312(tmp_path):
    if sys.version_info[:2] == (3, 12):
        pytest.skip("this interpreter is 3.12; the refusal needs another version")  # CPU CI runs 3.11
    result = subprocess.run(
        [SCRIPTS / "install.sh", "--python", sys.executable, "--target", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "the carried wheels are cp312" in result.stderr
    assert not (tmp_path / "site").exists()


# ---------------------------------------------------------------------------------- never in the image


def test_the_image_never_uses_the_test_environment():
    for path in (REPO / "docker" / "Dockerfile", REPO / "docker" / "install.sh"):
        text = path.read_text()
        for needle in (
            "sgl_kernel_standin",
            "gpu-test-closure",
            "gpu_env",
            ".whl",
            REQUIRE_UPSTREAM_ENV,
            "cpkv-site",
            gpu_env.PTH_FILE,
        ):
            assert needle not in text, f"{path} references the TEST-ONLY GPU environment ({needle})"
    standin_doc = sgl_kernel_standin.__doc__
    assert standin_doc.startswith("TEST-ONLY") and "Never part of the image" in standin_doc
    assert gpu_env.__doc__.startswith("TEST-ONLY")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
