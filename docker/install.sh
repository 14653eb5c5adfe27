#!/usr/bin/env bash
# The one install script of the image (docker/Dockerfile runs it; CI runs it against a virtual environment
# with --no-kernels, so a broken step fails CI without a Docker engine). From a checkout of this repo:
#   1. install our package, non-editable, into the target interpreter (built from a copy of the checkout);
#   2. apply the patch queue in-tree to that interpreter's sglang (or --sglang-root) with our overlay tool;
#   3. build our CUDA ops ahead of time for sm_90a/sm_100a/sm_103a into the installed package
#      (sglang_cpkv/ops/prebuilt/, where serving loads them; no compile at serving time);
#   4. verify: the tree carries exactly this checkout's queue as its record says (`overlay verify`), the
#      patched files compile, our package imports from outside the checkout, the prebuilt library matches
#      its sources and torch, and the patched upstream imports when it is the interpreter's own sglang.
#
#   docker/install.sh [--python PY] [--sglang-root DIR] [--arch 90a,100a,103a] [--no-kernels]
#     --python PY        the target interpreter (default: python3)
#     --sglang-root DIR  the upstream 'sglang' package dir to patch (default: the one PY imports)
#     --arch LIST        CUDA archs of the AOT build (default: 90a,100a,103a)
#     --no-kernels       skip the CUDA build (CI: no CUDA torch here); without it a missing nvcc is an error
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python=python3
sglang_root=""
archs="90a,100a,103a"
kernels=1

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --python) python="${2:?--python needs a value}"; shift 2 ;;
    --sglang-root) sglang_root="${2:?--sglang-root needs a value}"; shift 2 ;;
    --arch) archs="${2:?--arch needs a value}"; shift 2 ;;
    --no-kernels) kernels=0; shift ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

python="$(command -v "$python")" || die "--python $python: not found"
# Fail before changing anything when the CUDA ops or the plan's host layout cannot be built: every build tool,
# where the build steps look for it.
if [ "$kernels" = 1 ]; then
  nvcc="$(command -v nvcc || true)"
  if [ -z "$nvcc" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  fi
  [ -n "$nvcc" ] || die "nvcc not found (PATH, \$CUDA_HOME/bin): the image needs the CUDA toolkit to build our ops; pass --no-kernels to skip (CI only)"
  # torch's extension builder runs `ninja` from PATH; the target environment's own (pip install ninja) counts.
  if ! command -v ninja >/dev/null; then
    [ -x "$(dirname "$python")/ninja" ] \
      || die "ninja not found (PATH, $(dirname "$python")): torch builds our CUDA ops with it (pip install ninja, or apt-get install ninja-build); pass --no-kernels to skip (CI only)"
    PATH="$(dirname "$python"):$PATH"
  fi
  # torch compiles the ops' host code with $CXX, else c++.
  command -v "${CXX:-c++}" >/dev/null \
    || die "C++ compiler ${CXX:-c++} not found (set CXX): torch compiles our CUDA ops' host code with it; pass --no-kernels to skip (CI only)"
fi
# The plan's host layout (step 3b, with or without the kernels) is compiled with $CXX, else g++.
command -v "${CXX:-g++}" >/dev/null || die "C++ compiler ${CXX:-g++} not found (set CXX): the plan's host layout is built with it"
# Run every check from a neutral directory, so imports resolve to the installed package, not the checkout.
neutral="$(mktemp -d)"
trap 'rm -rf "$neutral"' EXIT
py() { (cd "$neutral" && env -u PYTHONPATH "$python" "$@"); }

if [ -z "$sglang_root" ]; then
  sglang_root="$(py -c 'import importlib.util, os; spec = importlib.util.find_spec("sglang"); print(os.path.dirname(spec.origin) if spec else "")')"
  [ -n "$sglang_root" ] || die "$python has no sglang; pass --sglang-root"
fi
sglang_root="$(cd "$sglang_root" && pwd)"
[ -f "$sglang_root/__init__.py" ] || die "--sglang-root $sglang_root is not the 'sglang' package directory"
log "target: $("$python" --version 2>&1) ($(command -v "$python")), sglang at $sglang_root"

# 1. Our package, non-editable. Built from a copy so that nothing is written into the checkout
#    (setuptools builds in-tree); the copy keeps the layout the package's links and readme expect.
src="$neutral/src"
mkdir -p "$src"
tar -C "$repo" --exclude='__pycache__' --exclude='*.egg-info' --exclude='build' -cf - python sgl-kernel \
  | tar -C "$src" -xf -
pip_args=(--disable-pip-version-check -q)
# The image's system interpreter is the serving environment (upstream installs sglang there too), so a PEP 668
# marker on it is not a reason to stop; a virtual environment never carries one.
if py -c 'import sys, sysconfig, pathlib; sys.exit(not (sys.prefix == sys.base_prefix and (pathlib.Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").exists()))'; then
  log "$python is externally managed (PEP 668); installing into it anyway (--break-system-packages)"
  pip_args+=(--break-system-packages)
fi
# Build offline with the target's own setuptools (no build isolation); fetch the build requirements only
# when the target lacks them.
missing="$(py - "$src/python/pyproject.toml" <<'PY'
import sys, tomllib
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement

for line in tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]:
    req = Requirement(line)
    try:
        ok = req.specifier.contains(version(req.name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    if not ok:
        print(line)
PY
)"
if [ -n "$missing" ]; then
  log "installing the build requirements the target lacks: $(echo $missing)"
  # shellcheck disable=SC2086 # one requirement per word
  py -m pip install "${pip_args[@]}" $missing
fi
log "installing sglang_cpkv (non-editable)"
py -m pip install "${pip_args[@]}" --no-deps --no-build-isolation --no-index "$src/python"
pkg_dir="$(py -c 'import os, sglang_cpkv; print(os.path.dirname(sglang_cpkv.__file__))')"
case "$pkg_dir" in
  "$repo"/*) die "sglang_cpkv imports from the checkout ($pkg_dir), not from the installed copy" ;;
esac
log "sglang_cpkv installed at $pkg_dir"

# 2. The patch queue, in-tree, with the installed overlay tool and this checkout's queue.
py -m sglang_cpkv.overlay --queue-root "$repo" apply --sglang-root "$sglang_root"

# 3. CUDA ops, ahead of time, into the installed package.
if [ "$kernels" = 1 ]; then
  log "building the CUDA ops for $archs with $nvcc"
  PATH="$(dirname "$nvcc"):$PATH" py -m sglang_cpkv.ops.cuda_build --aot --arch "$archs" --out "$pkg_dir/ops/prebuilt"
else
  log "--no-kernels: skipping the CUDA ops build (serving would fall back to the Triton ops)"
fi

# 4. Verification.
py -m sglang_cpkv.overlay --queue-root "$repo" verify --sglang-root "$sglang_root" \
  || die "the installed sglang does not carry the patch queue (overlay verify, above)"
py - "$sglang_root" <<'PY'
import json, py_compile, sys
from pathlib import Path

root = Path(sys.argv[1])
record = json.loads((root / ".sglang_cpkv_overlay.json").read_text())
for rel in record["files"]:
    py_compile.compile(str(root / rel), doraise=True)
print(f"[install] {len(record['files'])} patched upstream files compile ({record['upstream']}, queue {record['queue_sha256'][:12]})", file=sys.stderr)
PY
py -c 'import sglang_cpkv, sglang_cpkv.ops, sglang_cpkv.pd_launch, sglang_cpkv.contamination_client; print("[install] sglang_cpkv", sglang_cpkv.__version__, "imports", file=__import__("sys").stderr)'
if [ "$kernels" = 1 ]; then
  py - <<'PY'
import sys
from sglang_cpkv.ops import cuda_build

library = cuda_build.prebuilt_library()
if library is None or not library.is_file():
    sys.exit("[install] error: no prebuilt CUDA library in the installed package")
reason = cuda_build.stale_reason(library)
if reason:
    sys.exit(f"[install] error: {reason}")
print(f"[install] prebuilt CUDA ops: {library}", file=sys.stderr)
PY
fi
# Mooncake's transfer engine moves the prefill's KV to the decode (upstream's image ships its CUDA build; a CPU
# environment the non-CUDA one of requirements/dev-cpu.txt); it links the system's libibverbs1.
engine_error="$(py -c 'import mooncake.engine' 2>&1 | tail -1)" ||
  case "$engine_error" in
    *libibverbs*) die "Mooncake's transfer engine needs the system package libibverbs1 (apt-get install libibverbs1): $engine_error" ;;
    *) die "Mooncake's transfer engine does not import (pip install mooncake-transfer-engine, the CUDA build upstream's image ships): $engine_error" ;;
  esac
log "Mooncake's transfer engine imports"
importable_root="$(py -c 'import importlib.util, os; spec = importlib.util.find_spec("sglang"); print(os.path.dirname(spec.origin) if spec else "")')"
if [ "$importable_root" = "$sglang_root" ]; then
  py -c 'import sglang.srt.server_args' && log "patched sglang.srt.server_args imports"
else
  log "the patched tree is not $python's own sglang; skipping its import check"
fi
log "done"
