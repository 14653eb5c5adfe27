"""TEST-ONLY: the GPU test environment's checks and activation files (used by ``scripts/gpu_env/*.sh``).

Never part of the image or of serving. On a CPU machine ``scripts/gpu_env/prepare_wheels.sh`` downloads the pinned
cp312 wheel and its import closure into ``.whl/``; on the GPU machine ``scripts/gpu_env/install.sh`` installs them,
applies the patch queue and activates the ``sgl_kernel`` stand-in (a ``.pth`` file, and a ``sitecustomize.py`` that
makes the target a site directory). What they need beyond shell is here, so CPU CI tests it: ``docs/operations.md``.

    python -m sglang_cpkv.testing.gpu_env verify-wheels --wheels .whl     # the files agree with the pins
    python -m sglang_cpkv.testing.gpu_env activate --target DIR --repo .  # .pth, sitecustomize, env file
    python -m sglang_cpkv.testing.gpu_env check --wheels .whl             # inside the env: versions, imports
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sglang_cpkv.envs import envs
from sglang_cpkv.overlay.common import OverlayError, sha256_file
from sglang_cpkv.overlay.pin import find_queue_root, load_pin
from sglang_cpkv.testing.upstream_env import REQUIRE_UPSTREAM_ENV

PY_TAG = "cp312"  # the GPU machine's interpreter (device KINDS.md); the closure's wheels are for it
CLOSURE_FILE = Path("requirements") / "gpu-test-closure.txt"
MARKER_FILE = ".sglang-cpkv-gpu-test-env"
PTH_FILE = "sglang_cpkv_sgl_kernel_standin.pth"
ENV_FILE = "cpkv-env.sh"
ENV_DIR_VAR = envs.SGLANG_CPKV_GPU_TEST_ENV.name
# Upstream modules the upstream-backed CUDA tests and the DSA attention kit import: `check` imports each.
IMPORT_CHECKS = (
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.runtime_context",
    "sglang.kernels.ops.kvcache.dsa_fused_store_index_cache",
    "sglang.srt.layers.attention.dsa_backend",
    "sglang.srt.managers.scheduler",  # the GPU soak drives its methods
    "sglang.kernels.ops.attention.dsa.triton_sparse_mla_prefill",
    "sglang.kernels.ops.attention.flash_mla_interface",  # the flash_mla library: the flashmla_* routes' kernels
    "sglang.test.kits.attention_unittest.attention_methods.dsa_attention",
)
# Requirements of closure wheels that stay behind on purpose: nothing on the tested paths imports them (ipython's
# terminal, openai's fast JSON parser). `check` names them in one line instead of warning about each.
NOT_CARRIED = frozenset(
    {"jedi", "prompt-toolkit", "stack-data", "pexpect", "matplotlib-inline", "ipython-pygments-lexers", "jiter"}
)
_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s+--hash=sha256:([0-9a-f]{64})$")


class GpuEnvError(Exception):
    """A refusal meant for the user (the CLI prints it and exits 1)."""


@dataclass(frozen=True)
class ClosureEntry:
    name: str  # normalized (PEP 503)
    version: str
    sha256: str


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_closure(path: Path) -> list[ClosureEntry]:
    """The closure file's entries; every non-comment line must be ``name==version --hash=sha256:HEX``."""
    entries: list[ClosureEntry] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            raise GpuEnvError(f"{path}:{number}: expected 'name==version --hash=sha256:<64 hex>', got {raw!r}")
        entries.append(ClosureEntry(normalize(match.group(1)), match.group(2), match.group(3)))
    names = [e.name for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise GpuEnvError(f"{path}: listed more than once: {', '.join(dupes)}")
    return entries


def wheel_name_version(filename: str) -> tuple[str, str]:
    parts = filename[: -len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        raise GpuEnvError(f"{filename}: not a wheel file name")
    return normalize(parts[0]), parts[1]


def pinned_upstream(repo: Path, tag: str = PY_TAG):
    """``UPSTREAM.toml``'s pin and its wheel for ``tag`` (through the overlay tool's reader)."""
    pin = load_pin(repo)
    if tag not in pin.wheels:
        raise GpuEnvError(f"UPSTREAM.toml pins no {tag} wheel (the GPU machine's Python): add [upstream.wheels.{tag}]")
    return pin, pin.wheels[tag]


def verify_wheels(repo: Path, wheel_dir: Path) -> list[str]:
    """Problems with ``wheel_dir`` against the pin and the closure (empty when it is exactly right)."""
    if not wheel_dir.is_dir():
        return [f"{wheel_dir} does not exist: run scripts/gpu_env/prepare_wheels.sh on a CPU machine"]
    _, want = pinned_upstream(repo)
    closure = {e.name: e for e in read_closure(repo / CLOSURE_FILE)}
    problems = []
    files = sorted(wheel_dir.glob("*.whl"))
    upstream = wheel_dir / want.filename
    if not upstream.is_file():
        problems.append(f"missing the pinned upstream wheel {want.filename} (UPSTREAM.toml [upstream.wheels.{PY_TAG}])")
    elif sha256_file(upstream) != want.sha256:
        problems.append(f"{want.filename}: sha256 {sha256_file(upstream)} differs from the pin {want.sha256}")
    seen: dict[str, list[Path]] = {}
    for path in files:
        if path.name == want.filename:
            continue
        name, version = wheel_name_version(path.name)
        if name not in closure:
            problems.append(f"{path.name}: not in {CLOSURE_FILE} (one version of each package, nothing else)")
            continue
        seen.setdefault(name, []).append(path)
        entry = closure[name]
        if version != entry.version:
            problems.append(f"{path.name}: version {version}, the closure pins {entry.version}")
        elif sha256_file(path) != entry.sha256:
            problems.append(f"{path.name}: sha256 differs from the closure's {entry.sha256}")
    for name, entry in closure.items():
        found = seen.get(name, [])
        if not found:
            problems.append(f"missing {name}=={entry.version} (in {CLOSURE_FILE})")
        elif len(found) > 1:
            problems.append(f"{name}: {len(found)} wheels ({', '.join(p.name for p in found)}); keep one")
    return problems


def unmet_requirements(wheel_dir: Path) -> list[str]:
    """The closure wheels' own requirements that the running environment does not satisfy (for the log)."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion

    unmet = []
    for path in sorted(wheel_dir.glob("*.whl")):
        if normalize(path.name.split("-")[0]) == "sglang":
            continue  # upstream's own requirements are the full serving stack; the stand-in covers sgl_kernel
        with zipfile.ZipFile(path) as wheel:
            meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            lines = wheel.read(meta).decode("utf-8", "replace").splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if normalize(req.name) in NOT_CARRIED:
                continue
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                unmet.append(f"{path.name}: needs {req}, not installed")
                continue
            try:
                ok = req.specifier.contains(have, prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                unmet.append(f"{path.name}: needs {req}, found {req.name} {have}")
    return unmet


# ------------------------------------------------------------------------------------- activation

SITECUSTOMIZE = '''\
"""TEST-ONLY: written by scripts/gpu_env/install.sh (sglang-cpkv GPU test environment), never in the image.

Python reads .pth files only in site directories, not in PYTHONPATH entries: this makes the directory it lies
in one, so its .pth files run (among them {pth}, which serves `sgl_kernel` from the
import-only stand-in sglang_cpkv.testing.sgl_kernel_standin). Then it runs the sitecustomize it shadows, if any.
"""

import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import site as _site
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_site.addsitedir(_here)
_rest = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
_spec = _machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.origin and _os.path.abspath(_spec.origin) != _os.path.abspath(__file__):
    _shadowed = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_shadowed)
'''


def activate(target: Path, repo: Path) -> Path:
    """Write the activation files into ``target`` (an installed env dir); return the env file's path."""
    python_dir = (repo / "python").resolve()
    target = target.resolve()
    (target / MARKER_FILE).write_text("sglang-cpkv GPU test environment (scripts/gpu_env/install.sh); TEST-ONLY\n")
    (target / PTH_FILE).write_text(
        "# TEST-ONLY: sglang-cpkv GPU test environment (scripts/gpu_env/install.sh), never in the image:\n"
        "# serves `sgl_kernel` (not installed here) from an import-only stand-in whose callables raise.\n"
        f"{python_dir}\n"
        "import sglang_cpkv.testing.sgl_kernel_standin as _cpkv_standin; _cpkv_standin.install()\n"
    )
    (target / "sitecustomize.py").write_text(SITECUSTOMIZE.format(pth=PTH_FILE))
    env_file = target / ENV_FILE
    env_file.write_text(
        "# TEST-ONLY: source this for the sglang-cpkv GPU test environment (written by scripts/gpu_env/install.sh).\n"
        "# Upstream sglang from carried wheels with the patch queue applied, the `sgl_kernel` import-only stand-in,\n"
        f"# and {REQUIRE_UPSTREAM_ENV}=1: an upstream-backed test that cannot run fails instead of skipping.\n"
        f'export PYTHONPATH="{python_dir}:{target}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f"export {REQUIRE_UPSTREAM_ENV}=1\n"
        f'export {ENV_DIR_VAR}="{target}"\n'
    )
    return env_file


# ------------------------------------------------------------------------------------- check


def check(repo: Path, wheel_dir: Path) -> int:
    """Inside the env: print what it is made of, fail when a needed upstream module does not import."""
    import platform

    target = envs.SGLANG_CPKV_GPU_TEST_ENV.get()
    if not target:
        raise GpuEnvError(f"{ENV_DIR_VAR} is not set: source the env file that install.sh wrote first")
    print(f"python {platform.python_version()} ({sys.executable})")
    for dist in ("torch", "triton", "transformers", "numpy", "typing-extensions", "pydantic", "sglang"):
        try:
            print(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{dist}: not installed")
    import torch

    print(
        f"torch cuda {torch.version.cuda}, devices {torch.cuda.device_count()}"
        + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
    )
    pin, _ = pinned_upstream(repo)
    import sglang

    sglang_dir = Path(sglang.__file__).resolve().parent
    if Path(target).resolve() not in sglang_dir.parents:
        raise GpuEnvError(f"sglang imports from {sglang_dir}, not from the test environment {target}")
    if importlib.metadata.version("sglang") != pin.version:
        raise GpuEnvError(f"sglang {importlib.metadata.version('sglang')} is not the pinned {pin.version}")
    record = sglang_dir / ".sglang_cpkv_overlay.json"
    if not record.is_file():
        raise GpuEnvError(f"{sglang_dir} has no overlay record: the patch queue was not applied")
    applied = json.loads(record.read_text())
    print(f"patch queue applied: {len(applied['patches'])} patches (queue {applied['queue_sha256'][:12]})")
    import sgl_kernel

    if getattr(sgl_kernel, "__sglang_cpkv_standin__", False):
        print("sgl_kernel: the import-only TEST stand-in (sglang_cpkv.testing.sgl_kernel_standin)")
    else:
        print(f"sgl_kernel: a real one, {getattr(sgl_kernel, '__file__', '?')} (the stand-in stays out)")
    print(f"not carried on purpose (nothing tested imports them): {', '.join(sorted(NOT_CARRIED))}")
    for line in unmet_requirements(wheel_dir):
        print(f"warning: closure requirement not met by this machine: {line}")
    failed = []
    for name in IMPORT_CHECKS:
        try:
            importlib.import_module(name)
            print(f"import ok: {name}")
        except Exception as exc:
            failed.append(name)
            print(f"import FAILED: {name}: {type(exc).__name__}: {exc}")
    if failed:
        raise GpuEnvError(f"{len(failed)} upstream modules do not import here: {', '.join(failed)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_cpkv.testing.gpu_env", description=__doc__)
    parser.add_argument("--repo", type=Path, help="the checkout (default: the overlay tool's queue root)")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify-wheels", help="the wheel folder holds exactly the pinned wheel and the closure")
    verify.add_argument("--wheels", type=Path, required=True)
    act = sub.add_parser("activate", help="write the .pth, sitecustomize.py and env file into an installed target")
    act.add_argument("--target", type=Path, required=True)
    chk = sub.add_parser("check", help="inside the env: print versions, import the upstream modules the tests use")
    chk.add_argument("--wheels", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        repo = args.repo.resolve() if args.repo else find_queue_root()
        if args.command == "verify-wheels":
            problems = verify_wheels(repo, args.wheels)
            if problems:
                raise GpuEnvError(f"{args.wheels} does not match the pins:\n  " + "\n  ".join(problems))
            print(
                f"{args.wheels}: the pinned {PY_TAG} upstream wheel and {len(read_closure(repo / CLOSURE_FILE))} closure wheels, verified"
            )
        elif args.command == "activate":
            print(activate(args.target, repo))
        elif args.command == "check":
            return check(repo, args.wheels)
    except (GpuEnvError, OverlayError) as exc:
        print(f"gpu_env: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
