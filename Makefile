# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: install demo test test-alt lint typing bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

demo: install
	$(BIN)/python examples/orders.py

test: install
	$(BIN)/ruff check dramatiq_reliable tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/pytest -q

# The suite against a database and a vhost other than the defaults (docs/testing.md): proves no
# test hard-codes `postgres` or `/`.  Creates `dr_alt` in both when missing; needs psql and
# rabbitmqctl on this machine.
ALT_ADMIN_URL    ?= postgresql://postgres@127.0.0.1:5432/postgres
ALT_DATABASE_URL ?= postgresql://postgres@127.0.0.1:5432/dr_alt
ALT_RABBITMQ_URL ?= amqp://guest:guest@127.0.0.1:5672/dr_alt

test-alt: install
	psql "$(ALT_ADMIN_URL)" -Atc "SELECT 1 FROM pg_database WHERE datname = 'dr_alt'" | grep -q 1 \
	  || psql "$(ALT_ADMIN_URL)" -qc "CREATE DATABASE dr_alt"
	rabbitmqctl -q list_vhosts | grep -qx dr_alt || rabbitmqctl -q add_vhost dr_alt
	rabbitmqctl -q set_permissions -p dr_alt guest '.*' '.*' '.*'
	DATABASE_URL="$(ALT_DATABASE_URL)" RABBITMQ_URL="$(ALT_RABBITMQ_URL)" $(BIN)/pytest -q

bench: install
	$(BIN)/python benchmarks/relay.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
