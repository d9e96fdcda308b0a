# tandem: the two commands a newcomer needs are `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup model test test-fast demo lint compose-smoke

setup:            ## build .venv with the CPU stack (idempotent; a no-op when up to date)
	@bash scripts/bootstrap.sh

model: setup      ## convert the embedded SmolLM2-135M-Instruct (offline, once)
	@$(PY) -m shared.models prepare >/dev/null

test: model       ## the whole suite, end-to-end tests with the real vLLM and DeepSpeed engines included
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: model  ## everything but the slow end-to-end tests
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

demo: model       ## train SmolLM2 with GRPO on CPU and show it learn (see README)
	$(PY) scripts/demo.py

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

compose-smoke: setup  ## build the CPU image and run deploy/compose.cpu.yml for real (root; installs Docker)
	bash scripts/compose_smoke.sh
