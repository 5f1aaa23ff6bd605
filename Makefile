# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: install demo test lint typing docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

# The demo needs the package alone (no dev tools); the stamp skips the install on later runs
# until pyproject.toml changes.
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/signup

test: install
	$(BIN)/ruff check dramatiq_reliable tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/pytest -q

$(VENV)/.docs-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: install
	$(BIN)/python benchmarks/relay.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
