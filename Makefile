# Two commands do everything: `make demo` and `make test` (lint, the strict docs build, tests).
# Each builds .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# bash with pipefail: a command whose output is filtered keeps its exit status (docs).
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c

.PHONY: demo test lint docs dist bench results clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# The distribution was named aps before aps-rl; an older editable install owns `aps` too.
	$(PY) -m pip uninstall --quiet --yes aps 2>/dev/null || true
	$(PY) -m pip install --quiet -e '.[websocket,fast,ray,sb3,envpool,compression,atari,pettingzoo,metrics]' --group test --group lint --group examples --group docs --group experiments
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

lint: $(VENV)/.installed
	$(PY) -m ruff check aps tests examples benchmarks experiments
	$(PY) -m ruff format --check aps tests examples benchmarks experiments
	$(PY) -m mypy aps

# The documentation site, strict: a broken link, a page missing from the nav or an unresolved
# API reference fails. Not --quiet, which hides strict mode's warnings: the INFO lines are
# filtered out instead, and pipefail keeps mkdocs's exit status.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict 2>&1 | { grep -v '^INFO ' || true; }

# The release: the sdist and the wheel in dist/, checked as the package index will read them.
dist: $(VENV)/.installed
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

# tests/test_release.py installs the wheel that `dist` built into a fresh venv. The 25
# slowest tests are listed at the end: the suite must stay well inside CI's time.
test: lint docs dist
	APS_DIST=$(CURDIR)/dist $(PY) -m pytest -q --durations=25

bench: $(VENV)/.installed
	$(PY) benchmarks/throughput.py

# The APS reproduction suite (docs/results/aps.md): one night on 2 cores; resumable.
results: $(VENV)/.installed
	$(PY) -m experiments.aps

clean:
	rm -rf $(VENV) site dist .mypy_cache .ruff_cache .pytest_cache .hypothesis
