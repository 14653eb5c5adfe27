# The two commands a newcomer needs (README): `make demo` and `make test`.
# Both set up .venv themselves (scripts/setup_env.sh, idempotent).

VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python

.PHONY: setup lint test demo test-cuda mutation image image-test clean

setup:
	VENV=$(VENV) scripts/setup_env.sh

# ruff lint and format check over the whole tree (settings: python/pyproject.toml).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Lint, then the registered CPU suite: exactly what .ci/run runs. Triton kernels run in the interpreter.
# `overlay verify` checks that .venv's sglang carries the queue as setup applied it.
test: setup lint
	$(PY) -m sglang_cpkv.overlay check
	$(PY) -m sglang_cpkv.overlay verify
	TRITON_INTERPRET=1 $(PY) test/run_suite.py --hw cpu --jobs 2

# The seed's scenario: a bs>1 batch sharing a prefix page with current reuse, per request
# compared with bs=1, on CPU (cp=1 and cp=2 over gloo) or on a GPU when present.
demo: setup
	$(PY) -m sglang_cpkv.testing.demo

# On a GPU host, with its own python3 (no .venv: that one is the CPU build): the registered CUDA suites, the
# 2-GPU suite only where two GPUs exist. With .whl/ from scripts/gpu_env/prepare_wheels.sh (run on a CPU
# machine) it first installs the TEST-ONLY GPU test environment (scripts/gpu_env/install.sh); upstream-backed
# tests fail rather than skip either way.
GPU_PY ?= python3
GPU_SITE ?= /tmp/cpkv-site
test-cuda:
	scripts/gpu_env/run_cuda_suites.sh --python $(GPU_PY) --target $(GPU_SITE)

# Do the compatibility table's named tests catch a broken feature? Each one-line change of
# docs/design/cp-shared-kv-mutations.toml in a scratch copy, the row's tests run there (long: not part of `make test`);
# writes docs/design/cp-shared-kv-mutations-report.md.
mutation: setup
	TRITON_INTERPRET=1 $(PY) scripts/mutation.py

# The image on a Docker engine (docker/build.sh; BASE_IMAGE picks the base), and every command docs/operations.md and
# the compose file document run in containers of it (docker/test/image_test.py; long: not part of `make test`).
# Without the registry, make a TEST-ONLY stand-in base first: docker/test/make-standin-base.sh [--cuda DIR].
image:
	docker/build.sh $(IMAGE_ARGS)

image-test: setup
	$(PY) docker/test/image_test.py $(IMAGE_TEST_ARGS)

clean:
	rm -rf $(VENV) .cache
