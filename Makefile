# The two commands of README.md: `make serve` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test venv venv-dev lint typecheck layers clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml tests/requirements-reference.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	# torch only for reference tests against transformers: the pinned CPU wheel, never in kvcore itself
	$(PIP) install -q -r tests/requirements-reference.txt
	touch $(VENV)/.installed $@

venv: $(VENV)/.installed
venv-dev: $(VENV)/.installed-dev

serve: venv
	$(VENV)/bin/kvcore serve --host $(HOST) --port $(PORT)

lint: venv-dev
	$(VENV)/bin/ruff check src service tests tools
	$(VENV)/bin/lint-imports

typecheck: venv-dev
	$(VENV)/bin/mypy

test: venv-dev lint typecheck
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
