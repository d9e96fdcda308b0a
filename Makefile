# tandem: the two commands a newcomer needs are `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup model test test-fast demo lint compose-smoke

setup:            ## build .venv with the CPU stack (idempotent; a no-op when up to date)
	@bash scripts/bootstrap.sh

model: setup      ## convert the embedded SmolLM2-135M-Instruct (offline, once)
	@$(PY) -m shared.models prepare >/dev/null

# The fast tests run on two workers (pytest-xdist: 280 s -> 175 s on 2 cores); the end-to-end tests one at a
# time, since each real engine uses every core and two side by side ran slower than one after the other.
test: model       ## the whole suite, end-to-end tests with the real vLLM and DeepSpeed engines included
	$(PY) -m pytest -m "not slow" -n 2 $(PYTEST_ARGS)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-fast: model  ## everything but the slow end-to-end tests
	$(PY) -m pytest -m "not slow" -n 2 $(PYTEST_ARGS)

demo: model       ## train SmolLM2 with GRPO on CPU and show it learn (see README)
	$(PY) scripts/demo.py

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

compose-smoke: setup  ## build the CPU image and run deploy/compose.cpu.yml for real (root; installs Docker)
	bash scripts/compose_smoke.sh
