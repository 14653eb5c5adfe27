#!/usr/bin/env bash
# The image on a real engine (issue 54), on the project's 2-core CPU machine: Debian's docker.io 20.10 and
# docker-compose 1.29 (apt-get install -y --no-install-recommends docker.io debootstrap docker-compose), the daemon
# started as `dockerd --iptables=false --bridge=none` (stopped by its pid afterwards), builds with --network none,
# containers on --network host (loopback only). No registry is reachable, so the base is the TEST-ONLY stand-in.
set -euo pipefail
cd "$(dirname "$0")/../../.."
# 1. The stand-in base with the host's CUDA 13.0 toolkit and torch 2.13.0's CUDA build (its wheels and their NVIDIA
#    libraries downloaded beforehand: pip download --no-deps -d /var/tmp/standin/cudatorch "torch===2.13.0"
#    nvidia-cudnn-cu13 nvidia-cusparselt-cu13 nvidia-nccl-cu13==2.32.6 nvidia-nvshmem-cu13 "nvidia-cublas<14" ...
#    --python-version 3.11 --only-binary=:all: --platform manylinux_2_28_x86_64 ...; 2.7 GB).
docker/test/make-standin-base.sh --workdir /var/tmp/standin --cuda /usr/local/cuda-13.0 --cuda-wheels /var/tmp/standin/cudatorch
# 2. The image with the CUDA build (AOT for sm_90a, sm_100a, sm_103a in `docker build`), and one without it.
BASE_IMAGE=cpkv-standin-base:0.5.23-cuda docker/build.sh --tag sglang-cpkv:test-cuda
BASE_IMAGE=cpkv-standin-base:0.5.23-cuda docker/build.sh --tag sglang-cpkv:test --no-kernels
# 3. Every documented command in containers of them (image_test.json: each check and what it saw).
BASE_IMAGE=cpkv-standin-base:0.5.23-cuda .venv/bin/python docker/test/image_test.py --image sglang-cpkv:test \
  --cuda-image sglang-cpkv:test-cuda --build-checks --out benchmark/results/2026-12-07-image/image_test.json
