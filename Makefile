# Two commands on a fresh machine:
#   make run    server on an embedded PostgreSQL, plus an agent for this machine
#   make test   the whole test suite against real PostgreSQL, namespaces and Chromium
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test venv lint

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/meshwatch server --with-agent

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: venv
	$(BIN)/ruff check app agents tests
