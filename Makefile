# The README's two commands are `make run` and `make test`; both set up .venv on first use.
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup setup-test run chat test test-fast lint typecheck unit bench-engine generate \
	loadtest bench soak llama-server bench-peers bench-perplexity test-models

setup:
	@scripts/setup-env.sh

# The venv, plus the Debian packages some tests drive (nginx, chromium).
setup-test:
	@scripts/setup-env.sh --test-packages

# The chat service on http://127.0.0.1:8000 (bundled model, embedded Redis under ./data).
run: setup
	$(PY) -m service.cli serve $(ARGS)

chat: setup
	$(PY) -m service.cli chat

generate: setup
	$(PY) -m service.cli generate "$(PROMPT)"

lint: setup
	$(PY) -m ruff check protocol service kernels clients tests benchmarks loadtest deploy
	$(PY) -m ruff format --check protocol service kernels clients tests benchmarks loadtest deploy
	.venv/bin/clang-format --dry-run --Werror kernels/cpu/src/*.c kernels/cpu/src/*.h

typecheck: setup
	$(PY) -m mypy

# The in-process tests on two workers, then the tests that start processes one at a time
# (servers, Redis, nginx, a browser: on two workers they would contend for the two cores).
# Each run fails on its own exit code 5 (no tests collected).
unit: setup-test
	$(PY) -m pytest -m "not server" -n 2 --dist worksteal
	$(PY) -m pytest -m server

# Lint, types, then the whole suite. pytest's exit code 5 (no tests collected) fails too.
test: lint typecheck unit

# The in-process suite: pytest without the tests marked `server` (those that start a process:
# pagechat serve, redis-server, nginx, Locust, a browser, any subprocess), on two workers
# (pytest-xdist; no test here shares state across processes). No lint, no types.
test-fast: setup-test
	$(PY) -m pytest -m "not server" -n 2 --dist worksteal

bench-engine: setup
	$(PY) -m benchmarks.engine_step

# llama.cpp's llama-server, built once from the llama-cpp-python sdist's vendored sources into
# build/llama.cpp/ (git-ignored; once: 10-20 minutes with -j2). bench-peers needs it.
llama-server:
	@scripts/build-llama-server.sh

# pagechat serve (defaults, or each ARGS="--pagechat '...'" configuration) against llama-server
# on the bundled GGUF (or ARGS="--model FILE"): 1 / 8 / 32 streams, 128 tokens each,
# alternating, two rounds. Prints the tables, each naming the model's size and quant; JSON and
# markdown go to results/. Without llama-server it says so and exits 0.
# make bench-peers ARGS="--pagechat '' --pagechat '--num-threads 2'"
# make bench-peers ARGS="--model build/models/llama-3.2-1b-random-q4_k_m.gguf"
bench-peers: setup
	$(PY) -m benchmarks.peers --json results/peers.json --markdown results/peers.md $(ARGS)

# Random-weight models in the shapes of Llama-3.2-1B (and with SHAPES, Qwen2.5-1.5B,
# Llama-3.2-3B), converted and quantized to Q4_K_M, Q5_K_M and Q8_0 by the llama.cpp tree
# `make llama-server` builds, into build/models/ (~3 minutes and ~2.5 GB for the 1B shape).
# make test-models SHAPES="llama-3.2-1b qwen2.5-1.5b"
test-models: setup llama-server
	$(PY) -m benchmarks.test_models --shape $(or $(SHAPES),llama-3.2-1b)

# Perplexity per weight format (fp32, bf16, the stored blocks, gguf's requantizations) and CPU
# kernel version over benchmarks/data/alice-ch1-2.txt, each against its own dequantized fp32
# model (the whole text: ~40 minutes on 2 cores; ARGS="--max-tokens 1536": ~10). JSON to results/.
bench-perplexity: setup
	$(PY) -m benchmarks.perplexity --json results/perplexity.json $(ARGS)

# Locust, headless, against a server that is already running (make run): starts none itself.
# make loadtest URL=ws://127.0.0.1:8080 USERS=64 SPAWN_RATE=8 RUN_TIME=3m [ARGS="--tags oneshot"]
# CSV files and the HTML report go to results/loadtest-<time>/; the summary is printed.
loadtest: setup
	$(PY) -m loadtest.run --url $(or $(URL),ws://127.0.0.1:8000) --users $(or $(USERS),8) \
		--spawn-rate $(or $(SPAWN_RATE),2) --run-time $(or $(RUN_TIME),60s) $(ARGS)

# A soak: its own server (bundled model, embedded Redis in a temporary directory) under every
# Locust scenario for DURATION, sampled every INTERVAL seconds (RSS, open files, Redis keys and
# memory, KV blocks, loop lag), then judged; exits 1 naming any failed check. Samples, plot and
# verdict go to results/soak-<time>/. make soak DURATION=10m USERS=24 [ARGS="--doc"]
soak: setup
	$(PY) -m loadtest.soak --duration $(or $(DURATION),10m) --users $(or $(USERS),24) \
		--interval $(or $(INTERVAL),5) $(ARGS)

# The KV allocators on a chat trace (no model, ~20 s), then engine throughput paged vs
# contiguous on the real model (~12 min on 2 cores), then the plots in docs/img/ and the tables
# between the bench markers in docs/perf.md. JSON results go to results/ (ignored by git).
bench: setup
	$(PY) -m benchmarks.kv_memory --json results/kv_memory.json
	$(PY) -m benchmarks.throughput --json results/throughput.json
	$(PY) -m benchmarks.report --results results --doc docs/perf.md
