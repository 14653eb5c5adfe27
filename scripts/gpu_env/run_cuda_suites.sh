#!/usr/bin/env bash
# The registered CUDA suites on a GPU host (`make test-cuda`): cpkv-test-1-gpu, and cpkv-test-2-gpu only where
# the host has two GPUs or more. Upstream-backed tests must run: SGLANG_CPKV_REQUIRE_UPSTREAM=1 turns their
# skips into failures.
#   * With wheels in .whl/ (scripts/gpu_env/prepare_wheels.sh, run on a CPU machine): installs the TEST-ONLY
#     GPU test environment first (scripts/gpu_env/install.sh: the pinned upstream from those wheels, the patch
#     queue, the import-only sgl_kernel stand-in) and runs in it.
#   * Without: runs with the interpreter's own sglang (the image), patched already by docker/install.sh.
#
#   scripts/gpu_env/run_cuda_suites.sh [--python PY] [--target DIR]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
python=python3
target=/tmp/cpkv-site

log() { printf '[test-cuda] %s\n' "$*" >&2; }
die() { printf '[test-cuda] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --python) python="${2:?--python needs a value}"; shift 2 ;;
    --target) target="${2:?--target needs a value}"; shift 2 ;;
    -h | --help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The GPU tests run the mode's CUDA ops and fail where they cannot (never the Triton fallback): a prebuilt library
# (the image's, or SGLANG_CPKV_CUDA_LIB) is loaded first; without one the tests compile the ops (JIT, tests only).
export SGLANG_CPKV_CUDA_JIT="${SGLANG_CPKV_CUDA_JIT:-1}"
if compgen -G "$repo/.whl/*.whl" >/dev/null; then
  log "wheels in .whl/: installing the TEST-ONLY GPU test environment into $target"
  env_file="$(scripts/gpu_env/install.sh --python "$python" --target "$target")" || die "the GPU test environment did not install"
  # shellcheck disable=SC1090
  . "$env_file"
else
  log "no wheels in .whl/: using $python's own sglang (run scripts/gpu_env/prepare_wheels.sh on a CPU machine to carry one)"
  export SGLANG_CPKV_REQUIRE_UPSTREAM=1
fi

gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())')" || die "$python cannot import torch"
[ "$gpus" -ge 1 ] || die "no CUDA device visible to $python"

status=0
"$python" test/run_suite.py --hw cuda --suite cpkv-test-1-gpu || status=1
if [ "$gpus" -ge 2 ]; then
  "$python" test/run_suite.py --hw cuda --suite cpkv-test-2-gpu || status=1
else
  log "cpkv-test-2-gpu not run: this host has $gpus GPU (it needs two of one host)"
fi
exit "$status"
