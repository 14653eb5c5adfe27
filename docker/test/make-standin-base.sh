#!/usr/bin/env bash
# TEST-ONLY. Makes a local stand-in for upstream's release image (lmsysorg/sglang:v0.5.23-cu130) on a machine that
# cannot pull it, so that docker/Dockerfile can be built and its image tested there (make image-test). Never ship it:
# it has no GPU runtime, a CPU torch, and Mooncake's non-CUDA transfer engine.
#
# What it holds, where upstream's image holds it: Debian bookworm (debootstrap --variant=minbase) with python3 and
# pip; the pinned sglang wheel (UPSTREAM.toml, sha256-checked by the overlay tool) unpacked under
# /sgl-workspace/sglang/python and put on sys.path by a .pth (upstream's image installs sglang from that checkout);
# the Python packages of this checkout's CPU environment (.venv, from `make setup`: torch CPU, triton, the upstream
# import closure, sglang-router, Mooncake's engine) copied into the system site-packages; libibverbs1, g++ and
# ninja (upstream's image has its build tools); and with --cuda a copy of the host's CUDA toolkit at
# /usr/local/cuda (nvcc on PATH) and, in place of the CPU torch, the CUDA build of the same torch version with its
# NVIDIA libraries (--cuda-wheels: a directory of wheels, no index needed), for the image's CUDA build.
#
#   docker/test/make-standin-base.sh [--tag TAG] [--cuda DIR --cuda-wheels DIR] [--workdir DIR]
#     --tag TAG      image tag (default cpkv-standin-base:0.5.23-cpu; with --cuda: ...-cuda)
#     --cuda DIR     copy this CUDA toolkit (e.g. /usr/local/cuda-13.0) into the base
#     --cuda-wheels DIR  torch's CUDA wheel of the environment's torch version and its NVIDIA library wheels, e.g.
#                    pip download --no-deps -d DIR "torch===2.13.0" nvidia-cudnn-cu13 ... (the platform's tags)
#     --workdir DIR  where the Debian root file system is made and kept (default /var/tmp/cpkv-standin-base)
# Needs root (debootstrap), debootstrap, a running Docker engine, and the Debian mirror. Prints the tag.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tag=""
cuda=""
cuda_wheels=""
workdir=/var/tmp/cpkv-standin-base
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

log() { printf '[standin-base] %s\n' "$*" >&2; }
die() { printf '[standin-base] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
    --cuda) cuda="${2:?--cuda needs a directory}"; shift 2 ;;
    --cuda-wheels) cuda_wheels="${2:?--cuda-wheels needs a directory}"; shift 2 ;;
    --workdir) workdir="${2:?--workdir needs a value}"; shift 2 ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[ -n "$tag" ] || tag="cpkv-standin-base:0.5.23-$([ -n "$cuda" ] && echo cuda || echo cpu)"
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"
docker version >/dev/null 2>&1 || die "no Docker engine answers (start dockerd)"
if [ -n "$cuda" ]; then
  [ -x "$cuda/bin/nvcc" ] || die "--cuda $cuda: no bin/nvcc there"
  [ -n "$cuda_wheels" ] || die "--cuda needs --cuda-wheels (the CUDA build of torch: the ops link it)"
  ls "$cuda_wheels"/torch-*.whl >/dev/null 2>&1 || die "--cuda-wheels $cuda_wheels: no torch wheel there"
fi
venv_site="$(ls -d "$repo"/.venv/lib/python3.11/site-packages 2>/dev/null)" ||
  die "no $repo/.venv with Python 3.11 (run make setup): its packages make the base's Python environment"

rootfs="$workdir/rootfs"
if [ ! -x "$rootfs/usr/bin/python3" ]; then
  log "debootstrap bookworm into $rootfs (minutes)"
  rm -rf "$rootfs"
  mkdir -p "$workdir"
  debootstrap --variant=minbase \
    --include=python3,python3-pip,python3-venv,libibverbs1,ca-certificates,ninja-build,g++,procps,iproute2,patch,libnuma1,libcurl4 \
    bookworm "$rootfs" "$mirror" >"$workdir/debootstrap.log" 2>&1 || die "debootstrap failed: $workdir/debootstrap.log"
fi

stage="$workdir/stage"
rm -rf "$stage"
cp -a "$rootfs" "$stage"
site="$stage/usr/local/lib/python3.11/dist-packages"
mkdir -p "$site"
log "copying the CPU environment's packages from $venv_site"
tar -C "$venv_site" --exclude='./sglang' --exclude='./sglang-*.dist-info' --exclude='./sglang_cpkv*' \
  --exclude='./__editable__*' --exclude='*.pth' --exclude='__pycache__' -cf - . | tar -C "$site" -xf -

wheel="$(PYTHONPATH="$repo/python" "$repo/.venv/bin/python" -m sglang_cpkv.overlay --queue-root "$repo" fetch --python-tag cp311)" ||
  die "could not fetch the pinned cp311 sglang wheel"
log "unpacking $(basename "$wheel") into /sgl-workspace/sglang/python"
mkdir -p "$stage/sgl-workspace/sglang/python"
"$repo/.venv/bin/python" -m zipfile -e "$wheel" "$stage/sgl-workspace/sglang/python"
echo /sgl-workspace/sglang/python >"$site/sglang-workspace.pth"

changes=(--change 'ENV PYTHONUNBUFFERED=1' --change 'WORKDIR /sgl-workspace' --change 'CMD ["bash"]')
if [ -n "$cuda" ]; then
  log "copying the CUDA toolkit $cuda to /usr/local/cuda; torch's CUDA build from $cuda_wheels"
  cp -a "$(readlink -f "$cuda")" "$stage/usr/local/cuda"
  echo /usr/local/cuda/lib64 >"$stage/etc/ld.so.conf.d/cuda.conf"
  rm -rf "$site"/torch "$site"/torch-*.dist-info
  mkdir -p "$stage/tmp/wheels"
  cp "$cuda_wheels"/*.whl "$stage/tmp/wheels/"
  chroot "$stage" sh -c 'python3 -m pip install -q --no-deps --no-index --break-system-packages /tmp/wheels/*.whl && ldconfig' ||
    die "installing the CUDA wheels into the base failed"
  rm -rf "$stage/tmp/wheels"
  changes+=(--change 'ENV CUDA_HOME=/usr/local/cuda' \
    --change 'ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin')
fi
log "docker import -> $tag"
tar -C "$stage" -c . | docker import "${changes[@]}" \
  --message "TEST-ONLY stand-in for upstream's image (docker/test/make-standin-base.sh)" - "$tag" >/dev/null
rm -rf "$stage"
docker run --rm --network none "$tag" python3 -c 'import sglang, torch; print("[standin-base] sglang", sglang.__version__, "at", sglang.__path__[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' >&2
echo "$tag"
