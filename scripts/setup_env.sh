#!/usr/bin/env bash
# Create (or refresh) the CPU development environment in .venv: the pinned torch (the CPU build
# where the PyTorch CPU wheel index is reachable, else the default index's), triton (interpreter),
# test tools, the pinned upstream sglang installed --no-deps with our patch queue applied in-tree,
# and our package installed editable. It needs only the default package index (PyPI).
#
# CI (.ci/run via `make test`), `make demo` and a newcomer all use exactly this script; the
# Docker image runs the same overlay steps against the image's own sglang (docker/install.sh).
#
#   scripts/setup_env.sh                     # idempotent: reinstalls only what changed
#   VENV=/path scripts/setup_env.sh          # another location
#   TORCH_CPU_INDEX=URL scripts/setup_env.sh # a mirror of https://download.pytorch.org/whl/cpu
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3

log() { printf '[setup_env] %s\n' "$*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment $venv ($("$python" --version))"
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)

# 0. System libraries: Mooncake's transfer engine (the soak's P/D transfer, requirements/dev-cpu.txt) links Debian's
#    libibverbs1 even for TCP; installed here where this runs as root with apt (CI), else named and refused.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing libibverbs1 (Mooncake's transfer engine links it)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
  else
    log "error: the system package libibverbs1 is missing (Mooncake's transfer engine, which the soak runs, links it): install it (apt-get install libibverbs1) and run this again"
    exit 1
  fi
fi

# 1. Third-party packages: reinstalled only when the requirement files change.
req_stamp="$venv/.cpkv-requirements.sha256"
req_hash="$(cat requirements/dev-cpu.txt requirements/constraints-cpu.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$req_stamp" 2>/dev/null)" != "$req_hash" ]; then
  log "installing requirements/dev-cpu.txt (torch CPU build, triton, test tools, upstream import closure)"
  "${pip[@]}" install --upgrade pip
  # torch first, alone, so that every later resolution keeps it: the CPU build (no CUDA libraries,
  # no triton of its own) where the PyTorch CPU index answers, else the default index's build, which
  # on PyPI is the CUDA one with the triton that requirements/dev-cpu.txt pins too.
  torch_req="$(grep -E '^torch==' requirements/dev-cpu.txt)"
  torch_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  if "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=15).close()' \
    "$torch_index" 2>/dev/null; then
    log "torch: ${torch_req}+cpu from $torch_index"
    "${pip[@]}" install -c requirements/constraints-cpu.txt --extra-index-url "$torch_index" "${torch_req}+cpu"
  else
    log "torch: $torch_index is not reachable; $torch_req from the default index"
    "${pip[@]}" install -c requirements/constraints-cpu.txt "$torch_req"
  fi
  "${pip[@]}" install -c requirements/constraints-cpu.txt -r requirements/dev-cpu.txt
  echo "$req_hash" > "$req_stamp"
else
  log "requirements unchanged"
fi

# 2. Our package, editable (imports with torch and triton only).
"${pip[@]}" install --no-deps --no-build-isolation -e python/

# 3. The pinned upstream, --no-deps, freshly installed so the patch queue applies to pristine files.
wheel="$("$py" -m sglang_cpkv.overlay fetch)"
log "installing upstream wheel $(basename "$wheel") --no-deps"
"${pip[@]}" install --no-deps --force-reinstall --no-compile "$wheel"
sglang_root="$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("sglang").origin))')"

# 4. The patch queue, in-tree.
"$py" -m sglang_cpkv.overlay apply --sglang-root "$sglang_root"
log "ready: $venv (sglang at $sglang_root)"
