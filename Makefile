# Two commands do everything: `make demo` and `make test` (lint, the strict docs build, tests).
# Each builds .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint docs bench results clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[websocket,fast,ray,sb3,envpool,compression]' --group test --group lint --group examples --group docs --group experiments
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

lint: $(VENV)/.installed
	$(PY) -m ruff check aps tests examples benchmarks experiments
	$(PY) -m ruff format --check aps tests examples benchmarks experiments
	$(PY) -m mypy aps

# The documentation site, strict: a broken link or an unresolved API reference fails.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

test: lint docs
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/throughput.py

# The APS reproduction suite (docs/results/aps.md): one night on 2 cores; resumable.
results: $(VENV)/.installed
	$(PY) -m experiments.aps

clean:
	rm -rf $(VENV) site .mypy_cache .ruff_cache .pytest_cache .hypothesis
