#!/usr/bin/env bash
# Build the sglang-cpkv image (docker/Dockerfile) from this checkout: `make image` runs it.
#   docker/build.sh [--tag TAG] [--no-kernels] [-- DOCKER_BUILD_ARGS...]
#     --tag TAG       image tag (default sglang-cpkv:0.5.23, the version the pin names)
#     --no-kernels    an image without our CUDA ops (a base without the CUDA toolkit; serving runs the Triton ops)
#   BASE_IMAGE        the base (default: the Dockerfile's, upstream's release image of the pin)
#   CPKV_CUDA_ARCHS   CUDA archs of the AOT build (default 90a,100a,103a)
# Labels: the checkout's revision (with "-dirty" when it has uncommitted changes) and its clone URL with any
# credentials removed (CI clone URLs carry a token). Runs `docker build --network none`: the build downloads nothing.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tag="sglang-cpkv:0.5.23"
kernels=1
die() { printf '[image] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
    --no-kernels) kernels=0; shift ;;
    --) shift; break ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
command -v docker >/dev/null || die "docker is not installed"

revision="$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
[ "$revision" = unknown ] || [ -z "$(git -C "$repo" status --porcelain 2>/dev/null)" ] || revision="$revision-dirty"
# scheme://user:secret@host/path -> scheme://host/path; scp-like git@host:path names no secret and stays.
source_url="$(git -C "$repo" remote get-url origin 2>/dev/null | sed -E 's#^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@#\1#' || true)"

args=(--network none -f "$repo/docker/Dockerfile" -t "$tag"
  --build-arg "CPKV_REVISION=$revision" --build-arg "CPKV_SOURCE=${source_url:-unknown}"
  --build-arg "CPKV_KERNELS=$kernels")
[ -z "${BASE_IMAGE:-}" ] || args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
[ -z "${CPKV_CUDA_ARCHS:-}" ] || args+=(--build-arg "CPKV_CUDA_ARCHS=$CPKV_CUDA_ARCHS")
printf '[image] docker build %s (revision %s, base %s)\n' "$tag" "$revision" "${BASE_IMAGE:-the pinned release image}" >&2
docker build "${args[@]}" "$@" "$repo"
