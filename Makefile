# Two set-up commands, each building its own virtual environment on a fresh
# machine.  torch is pinned first (the CPU wheel); nothing later may pull
# another build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH ?= torch==2.13.0

.PHONY: demo demo-digits test lint venv bench clean docs-check docs-update docs

# The library (.) and the experiment harness kaisa-lab (./lab: the `kaisa`
# command, tasks, zoo) are installed editable in one call, so the resolver
# takes lab's `kaisa` requirement from this tree and torch stays pinned; lab's
# extra `baselines` (heavyball, pytorch-optimizer: SOAP, Shampoo, LAMB for
# kaisa compare) comes in the same call.
$(VENV)/.installed: pyproject.toml lab/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[dev]" -e "./lab[baselines]" "$(TORCH)"
	touch $@

venv: $(VENV)/.installed

## What a user should see: the text-lm character Transformer (2 blocks, width 128,
## 431k parameters) trained by AdamW, AdamW+K-FAC, Muon and Muon+K-FAC, each at
## the task's tuned lr, seed 0, each stopped at 2.5 validation bits/char (read every
## 20 steps, off the clock), one after the other in one process on one thread.
## Prints steps, time, step cost and the ratios to AdamW and to Muon, and K-FAC's
## verdict against each base; writes runs/demo/results.{json,png}.  3.5-4.5
## minutes on 2 cores at load 11-12, about 2.3 expected idle (README.md, "What
## make demo shows").
demo: venv
	$(VENV)/bin/kaisa compare --task text-lm --optimizers adamw,muon --seed 0 \
		--evals-per-epoch 10 --stop-at-target --threads 1 --out runs/demo

## The former demo, a second long: SGD and SGD+K-FAC on the digits CNN.
demo-digits: venv
	$(VENV)/bin/kaisa compare --task digits-cnn --out runs/demo-digits

## The whole test suite (unit, distributed on gloo, integration) plus lint.
test: venv lint
	$(PY) -m pytest -q --durations=15

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

## Step-time and communication benchmarks (tables + JSON + PNG under runs/bench).
bench: venv
	$(PY) benchmarks/step_time.py --out runs/bench
	$(PY) benchmarks/stages.py --out runs/bench
	$(PY) benchmarks/task_steps.py --out runs/bench
	$(PY) benchmarks/gram.py --out runs/bench
	$(PY) benchmarks/precision.py --out runs/bench
	$(PY) benchmarks/conv_capture.py --out runs/bench
	$(PY) benchmarks/plan_scale.py --out runs/bench
	$(PY) benchmarks/plan_paper.py --models resnet50 --out runs/bench
	for w in 1 2 4; do OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone \
		--nproc_per_node=$$w benchmarks/strategies.py --out runs/bench || exit 1; done
	OMP_NUM_THREADS=1 $(PY) benchmarks/tensor_parallel_comm.py --out runs/bench

clean:
	rm -rf $(VENV) runs site .pytest_cache .mypy_cache .ruff_cache
