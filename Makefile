# The README's two commands are `make run` and `make test`; both set up .venv on first use.
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup run chat test lint typecheck unit bench-engine generate

setup:
	@scripts/setup-env.sh

# The chat service on http://127.0.0.1:8000 (bundled model, embedded Redis under ./data).
run: setup
	$(PY) -m service.cli serve $(ARGS)

chat: setup
	$(PY) -m service.cli chat

generate: setup
	$(PY) -m service.cli generate "$(PROMPT)"

lint: setup
	$(PY) -m ruff check service kernels clients tests benchmarks
	$(PY) -m ruff format --check service kernels clients tests benchmarks

typecheck: setup
	$(PY) -m mypy

unit: setup
	$(PY) -m pytest

# Lint, types, then the whole suite. pytest's exit code 5 (no tests collected) fails too.
test: lint typecheck unit

bench-engine: setup
	$(PY) -m benchmarks.engine_step
