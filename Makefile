# Each target does its own set-up on a fresh machine: venv, project install, default-corpus cache.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.soma-installed

.PHONY: setup test demo bench clean

setup: $(STAMP)
	@$(PY) -m soma_edge.corpus fetch

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(VENV)/bin/soma-worker train --steps 600

clean:
	rm -rf runs .pytest_cache
