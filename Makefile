# The two commands a newcomer needs (README): `make demo` and `make test`.
# Both set up .venv themselves (scripts/setup_env.sh, idempotent).

VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python

.PHONY: setup lint test demo test-cuda clean

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
	$(PY) -m sglang_cpkv.demo

# On a GPU host (registered CUDA suites; the 2-GPU suite needs two GPUs of one host).
test-cuda: setup
	$(PY) test/run_suite.py --hw cuda --suite cpkv-test-1-gpu
	$(PY) test/run_suite.py --hw cuda --suite cpkv-test-2-gpu

clean:
	rm -rf $(VENV) .cache
