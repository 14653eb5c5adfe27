#!/usr/bin/env bash
# TEST-ONLY (the GPU test environment; never used by the Docker image). Run on a CPU machine with the package
# index: downloads into .whl/ (git-ignored) the wheels that scripts/gpu_env/install.sh installs on a GPU machine
# that cannot download anything:
#   * the upstream sglang wheel that UPSTREAM.toml pins for cp312 ([upstream.wheels.cp312]), sha256-checked
#     against the pin (by the overlay tool's fetch, which caches it in .cache/upstream);
#   * its import closure, requirements/gpu-test-closure.txt: exact versions, sha256-pinned, cp312 manylinux
#     x86_64 wheels, no dependencies resolved (--no-deps: the list is the closure).
# .whl/ is rebuilt from scratch (one version of each package: two stop the install), and the total must stay
# under the carry budget (the device tool carries 64 MiB with the repo).
#
#   scripts/gpu_env/prepare_wheels.sh            # from anywhere; writes <repo>/.whl
#   WHEEL_DIR=/path scripts/gpu_env/prepare_wheels.sh
#   MAX_MIB=58 scripts/gpu_env/prepare_wheels.sh  # the size limit it enforces (default 58)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
dest="${WHEEL_DIR:-$repo/.whl}"
max_mib="${MAX_MIB:-58}"
python="${PYTHON:-python3}"
closure="$repo/requirements/gpu-test-closure.txt"
# The GPU machine's interpreter: CPython 3.12 (KINDS.md). The pin's wheel table and the closure are for it.
py_tag=cp312
py_version=3.12

log() { printf '[prepare_wheels] %s\n' "$*" >&2; }
die() { printf '[prepare_wheels] error: %s\n' "$*" >&2; exit 1; }

command -v "$python" >/dev/null 2>&1 || die "$python not found (set PYTHON=...)"
[ -f "$closure" ] || die "$closure is missing"

mkdir -p "$repo/.cache"
tmp="$(mktemp -d "$repo/.cache/gpu-wheels.XXXXXX")" # git-ignored, and on the same file system as .whl/
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT

# 1. The pinned upstream wheel: the overlay tool downloads it for cp312 and refuses a sha256 that differs
#    from UPSTREAM.toml.
log "upstream wheel pinned for $py_tag (UPSTREAM.toml)"
wheel="$(PYTHONPATH="$repo/python" "$python" -m sglang_cpkv.overlay --queue-root "$repo" fetch --python-tag "$py_tag" --dest "$tmp")" ||
  die "could not fetch the pinned $py_tag upstream wheel (see above)"
log "verified $(basename "$wheel")"

# 2. The closure: exact pins with hashes, binary wheels only, for the GPU machine's interpreter and platform.
log "import closure ($(grep -cE '^[A-Za-z0-9]' "$closure") packages, requirements/gpu-test-closure.txt)"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
  --python-version "$py_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -r "$closure" -d "$tmp" || die "pip download of the closure failed (see above)"

# 3. Exactly one wheel per listed package, nothing else.
want="$(grep -cE '^[A-Za-z0-9]' "$closure")"
got="$(find "$tmp" -maxdepth 1 -name '*.whl' ! -name "$(basename "$wheel")" | wc -l)"
[ "$got" -eq "$want" ] || die "expected $want closure wheels, found $got in $tmp"

bytes="$(find "$tmp" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s}')"
mib=$((bytes / 1048576))
[ "$bytes" -le $((max_mib * 1048576)) ] || die "the wheels take $mib MiB, over the $max_mib MiB limit (MAX_MIB)"

if [ -e "$dest" ]; then
  [ -d "$dest" ] || die "$dest exists and is not a directory"
  others="$(find "$dest" -mindepth 1 -maxdepth 1 ! -name '*.whl' | head -3)"
  [ -z "$others" ] || die "$dest holds more than wheels ($others ...): refusing to replace it"
  rm -rf "$dest"
fi
mv "$tmp" "$dest"
trap - EXIT
log "ready: $dest ($((got + 1)) wheels, $mib MiB); on the GPU machine: scripts/gpu_env/install.sh"
