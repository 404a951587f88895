# The two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On the project's CPU machines `torch==2.13.0` resolves to the CPU wheel on disk.
# With a GPU, install your own CUDA torch into .venv first; it is kept (see below).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m hybridflow demo

test: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check hybridflow tests bench examples
	$(VENV)/bin/ruff format --check hybridflow tests bench examples

bench: $(VENV)/.installed
	$(PY) -m hybridflow bench transport --json

clean:
	rm -rf $(VENV) runs .pytest_cache
