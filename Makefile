# leaflens: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ART ?= artifacts
DATA ?= $(ART)/synthetic
SIZE ?= 64

.PHONY: help test lint bench-engine bench-mnist train-example clean

help:
	@echo "make test           run the default test suite (creates $(VENV) on first use)"
	@echo "make train-example  train the engine on a built-in toy example"
	@echo "make bench-engine   engine training-step speed (vs PyTorch when installed)"
	@echo "make bench-mnist    MNIST with the engine (MNIST=dir with the IDX files)"
	@echo "make lint           ruff"

# The virtual environment is rebuilt when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,serve-cpu]"
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(PY) -m ruff check .

train-example: $(VENV)/.installed
	$(PY) -m pipeline.cli train-example

bench-engine: $(VENV)/.installed
	$(PY) benchmarks/engine_speed.py

MNIST ?= ../shared/data/mnist
bench-mnist: $(VENV)/.installed
	$(PY) benchmarks/mnist.py --data $(MNIST)

clean:
	rm -rf $(ART) .pytest_cache
