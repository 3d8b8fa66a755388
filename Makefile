# Two entry points for a fresh machine: `make run` (the service) and `make test` (the suite).
# Both create .venv when it is missing and are safe to run again.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test test-multihost lint migrate clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# database_ensure creates a PostgreSQL database that DATABASE_URL names and the server lacks (or
# says which createdb to run); a no-op on SQLite.
migrate: $(VENV)/.installed-run
	$(PY) manage.py database_ensure
	$(PY) manage.py migrate --noinput

# `bin/run --check` first: a port in use (another `make run`) stops this one before it touches
# the database or the running instance's metrics.
run: $(VENV)/.installed-run
	@HOST=$(HOST) PORT=$(PORT) PY=$(PY) bin/run --check
	$(PY) manage.py database_ensure
	$(PY) manage.py migrate --noinput
	$(PY) manage.py telemachus_demo
	HOST=$(HOST) PORT=$(PORT) PY=$(PY) bin/run

test: $(VENV)/.installed-dev
	$(PY) -m pytest $(PYTEST_ARGS)

# Hosts in network namespaces (root; iproute2, socat; PostgreSQL and Redis on the loopback): bin/multihost-test.
test-multihost: $(VENV)/.installed-dev
	PY=$(PY) bin/multihost-test $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) var .pytest_cache
