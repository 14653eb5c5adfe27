#!/usr/bin/env bash
# TEST-ONLY (the GPU test environment; never used by the Docker image, which has the full upstream stack).
# On a GPU machine that has torch/triton/pytest but no upstream sglang and no network, from the wheels that
# scripts/gpu_env/prepare_wheels.sh put in .whl/ on a CPU machine:
#   1. checks them against the pins (UPSTREAM.toml's cp312 wheel, requirements/gpu-test-closure.txt);
#   2. installs them --no-index --no-deps into a fresh target directory (default /tmp/cpkv-site);
#   3. applies the patch queue to that sglang tree with our overlay tool;
#   4. activates the import-only `sgl_kernel` stand-in (python/sglang_cpkv/testing/sgl_kernel_standin.py)
#      through a .pth file in the target (plus a sitecustomize.py there: Python reads .pth files only in site
#      directories, not in PYTHONPATH entries) -- TEST-ONLY: anything that calls sgl_kernel fails loudly;
#   5. writes TARGET/cpkv-env.sh (PYTHONPATH, SGLANG_CPKV_REQUIRE_UPSTREAM=1: upstream-backed tests fail
#      instead of skipping) and checks the result in a fresh interpreter: versions, the stand-in, and that the
#      upstream modules the CUDA tests and the DSA attention kit use import.
# Prints the env file's path on stdout (logs go to stderr):
#
#   scripts/gpu_env/install.sh [--target DIR] [--wheels DIR] [--python PY]
#   . /tmp/cpkv-site/cpkv-env.sh && python3 test/run_suite.py --hw cuda --suite cpkv-test-1-gpu
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target=/tmp/cpkv-site
wheels="$repo/.whl"
python=python3

log() { printf '[gpu_env] %s\n' "$*" >&2; }
die() { printf '[gpu_env] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="${2:?--target needs a value}"; shift 2 ;;
    --wheels) wheels="${2:?--wheels needs a value}"; shift 2 ;;
    --python) python="${2:?--python needs a value}"; shift 2 ;;
    -h | --help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

python="$(command -v "$python")" || die "--python $python: not found"
# Our package's tools come from this checkout (they import the standard library only at this point).
tool() { PYTHONPATH="$repo/python" "$python" "$@"; }

version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$version" = 3.12 ] || die "$python is Python $version: the carried wheels are cp312 (UPSTREAM.toml [upstream.wheels.cp312])"
"$python" -c 'import torch, triton' 2>/dev/null || die "$python cannot import torch and triton: this is for a GPU machine's image"

log "1/5 checking $wheels against UPSTREAM.toml and requirements/gpu-test-closure.txt"
tool -m sglang_cpkv.testing.gpu_env --repo "$repo" verify-wheels --wheels "$wheels" >&2 ||
  die "the wheels do not match the pins: rerun scripts/gpu_env/prepare_wheels.sh on a CPU machine"

log "2/5 installing into $target (fresh, --no-index --no-deps)"
if [ -e "$target" ]; then
  [ -d "$target" ] || die "--target $target exists and is not a directory"
  if [ -n "$(ls -A "$target")" ] && [ ! -f "$target/.sglang-cpkv-gpu-test-env" ]; then
    die "--target $target is not empty and was not made by this script: refusing to replace it"
  fi
  rm -rf "$target"
fi
mkdir -p "$target"
target="$(cd "$target" && pwd)"
PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  --target "$target" "$wheels"/*.whl || die "pip install of $wheels/*.whl into $target failed"

log "3/5 applying the patch queue to $target/sglang"
tool -m sglang_cpkv.overlay --queue-root "$repo" apply --sglang-root "$target/sglang" ||
  die "the patch queue does not apply to $target/sglang"

log "4/5 activating the TEST-ONLY sgl_kernel import stand-in ($target/sglang_cpkv_sgl_kernel_standin.pth)"
env_file="$(tool -m sglang_cpkv.testing.gpu_env --repo "$repo" activate --target "$target")" ||
  die "could not write the activation files into $target"

log "5/5 checking the environment in a fresh interpreter"
(
  # shellcheck disable=SC1090
  . "$env_file"
  cd "$(mktemp -d)" # imports must resolve through the environment, not the current directory
  "$python" -m sglang_cpkv.testing.gpu_env --repo "$repo" check --wheels "$wheels" >&2
) || die "the environment in $target does not work (see above)"

log "ready: . $env_file"
echo "$env_file"
