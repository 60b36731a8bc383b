# The two commands of the README: `make run` and `make test`. Both set everything up on a
# fresh machine: a .venv, torch first (this machine has its CPU wheel on disk), then fornax.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m-instruct

.PHONY: setup run test pull clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

pull: setup
	$(BIN)/fornax pull $(MODEL)

run: pull
	$(BIN)/fornax generate --model $(MODEL) "What is LLM inference? Answer in two sentences."

test: pull
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
