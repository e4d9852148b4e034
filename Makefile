# Two set-up commands, each building its own virtual environment on a fresh
# machine.  torch is pinned first (the CPU wheel); nothing later may pull
# another build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH ?= torch==2.13.0

.PHONY: demo demo-digits test test-torch lint venv bench clean docs-check docs-update docs

# The library (.) and the experiment harness kaisa-lab (./lab: the `kaisa`
# command, tasks, zoo, benchmark suite) are installed editable in one call, so
# the resolver takes lab's `kaisa` requirement from this tree and torch stays
# pinned; lab's extra `baselines` (heavyball, pytorch-optimizer: SOAP,
# Shampoo, LAMB) comes in the same call.  That is all the demo needs
# ($(VENV)/.base); the tests add the `dev` extra (the frameworks kaisa
# integrates with, the docs tools, lint) to the same environment.
$(VENV)/.base: pyproject.toml lab/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e . -e "./lab[baselines]" "$(TORCH)"
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PIP) install --quiet -e ".[dev]" -e "./lab[baselines]" "$(TORCH)"
	touch $@

venv: $(VENV)/.installed

## What a user should see: the text-lm character Transformer (2 blocks, width 128,
## 431k parameters) trained by AdamW, AdamW+K-FAC, Muon and Muon+K-FAC (K-FAC at
## the library's defaults), each at the lr the benchmark suite selected for it
## (the task's prior, and a note saying so, where it has none), seed 0, each
## stopped at 2.5 validation bits/char (read every 20 steps, off the clock), the
## four in lockstep in one process on one thread.  Prints steps, time, step cost,
## the ratios to AdamW and to Muon and K-FAC's verdict against each base; writes
## runs/demo/results.{json,png}.  A few minutes on 2 cores.
demo: $(VENV)/.base
	$(VENV)/bin/kaisa compare --task text-lm --optimizers adamw,muon --seed 0 \
		--evals-per-epoch 10 --stop-at-target --threads 1 --out runs/demo

## A smaller comparison, seconds long: SGD and SGD+K-FAC on the digits CNN.
demo-digits: $(VENV)/.base
	$(VENV)/bin/kaisa compare --task digits-cnn --out runs/demo-digits

## The whole test suite (unit, distributed on gloo, integration) plus lint.
test: venv lint
	$(PY) -m pytest -q --durations=15

## The unit suite on another torch release, in its own environment (.venv-torch): the
## library, the lab, pytest and mypy beside TEST_TORCH (default: the oldest release kaisa
## supports, with the numpy it was built against).  Tests of a feature that needs a newer
## torch skip, each saying which release and why (kaisa.torch_support: torch.compile's
## floor).  The frameworks (DeepSpeed, Lightning, accelerate, transformers, which needs
## torch >= 2.6) are tested by make test only, on the pinned torch.  PyPI's build of an
## older torch is a CUDA one (a few GB); it runs on the CPU here.  CI runs this after
## make test.
TEST_TORCH ?= "torch==2.4.1" "numpy<2"
test-torch:
	rm -rf .venv-torch
	$(PYTHON) -m venv .venv-torch
	.venv-torch/bin/pip install --quiet --upgrade pip
	.venv-torch/bin/pip install --quiet $(TEST_TORCH)
	.venv-torch/bin/pip install --quiet -e . -e ./lab pytest pytest-timeout "mypy>=1.8" \
		$(TEST_TORCH)
	.venv-torch/bin/python -c "import torch; print('torch', torch.__version__)"
	.venv-torch/bin/python -m pytest -q -p no:cacheprovider tests/unit

lint: venv
	$(VENV)/bin/ruff check src lab tests benchmarks examples tools
	$(VENV)/bin/ruff format --check src lab tests benchmarks examples tools
	$(VENV)/bin/mypy

## The docs' generated regions (plans, bytes, memory) against the commands that print
## them: a diff and exit 1 on drift (tools/docs_check.py; the test suite runs it too).
docs-check: venv
	$(PY) tools/docs_check.py

## Rewrite every generated region of README.md and docs/**/*.md from its command.
docs-update: venv
	$(PY) tools/docs_check.py --write

## The documentation site (mkdocs.yml: README.md, the guides under docs/, the API
## reference from the docstrings) in site/, strictly: any warning (a broken link or
## anchor, a docstring griffe cannot read) fails it.  The test suite builds it too.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

## The benchmark suite's quick cases (seconds each): the tuning protocol end to end on a
## small case, and every cost case with its quick options.  Records go to runs/bench, not
## to benchmarks/records (the docs render the newest records there).  A full case runs by
## name: kaisa bench list; kaisa bench run CASE (docs/benchmarks.md).
BENCH := OMP_NUM_THREADS=1 $(VENV)/bin/kaisa bench run
bench: venv
	$(BENCH) quick --records runs/bench --no-wait
	for c in gram step-cost task-step-cost precision conv-capture compile-step plan-scale \
		plan-paper strategies tensor-parallel-comm stages step-launches step-breakdown \
		plan-accuracy; do \
		$(BENCH) $$c --quick --records runs/bench || exit 1; done

clean:
	rm -rf $(VENV) .venv-torch runs site .pytest_cache .mypy_cache .ruff_cache
