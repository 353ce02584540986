# Two entry points, both starting from nothing but python3 and pip:
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install with the test extra, lint, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q -c constraints.txt

.PHONY: demo test install install-test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) -e .

install-test: $(BIN)/python
	$(PIP) -e ".[test]"

demo: install
	$(BIN)/multihead demo

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest
