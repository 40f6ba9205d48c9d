#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-perplexity and llama-quantize (CPU only) into
# build/llama.cpp/ (git-ignored), for benchmarks/peers.py, benchmarks/perplexity.py
# --llama-perplexity and scripts/make-test-models.sh. The sources are the llama.cpp vendored in the llama-cpp-python sdist on
# the package index: a pinned release, fetched with pip, so no git remote is needed. The first
# run takes ~4 minutes to fetch the sdist and ~10 CPU-minutes to compile (-j2: 5 minutes on two
# quiet cores, 18 on a busy shared machine); a later run finds the binary and does nothing
# (delete build/llama.cpp to rebuild). Prints the binary's path on success.
#
# Serve with --no-repack on the project's EPYC machines: the repacked (AMX/AVX512) Q4 path
# crashed llama-server on one of them. benchmarks/peers.py passes it.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.36  # llama-cpp-python; its vendor/llama.cpp is the llama.cpp built here
root=build/llama.cpp
binary=$root/bin/llama-server
jobs=${JOBS:-2}

if [ -x "$binary" ] && [ -x "$root/bin/llama-perplexity" ] && [ -x "$root/bin/llama-quantize" ]; then
    echo "$binary"
    exit 0
fi
mkdir -p "$root"
sdist=$root/llama_cpp_python-$version.tar.gz
if [ ! -f "$sdist" ]; then
    py=.venv/bin/python
    [ -x "$py" ] || py=${PYTHON:-python3}
    # --no-binary: the sdist (the wheel has no llama.cpp sources). pip prepares its metadata,
    # which takes a few minutes (scikit-build-core in an isolated environment).
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary :all: "llama-cpp-python==$version" -d "$root"
fi
src=$root/llama_cpp_python-$version/vendor/llama.cpp
[ -f "$src/CMakeLists.txt" ] || tar -xzf "$sdist" -C "$root"

# Static libraries: one self-contained binary. No web UI (LLAMA_USE_PREBUILT_UI would fetch
# it from Hugging Face), no HTTPS, no tests or examples: only what serving over loopback needs.
cmake -S "$src" -B "$root/cmake" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$root/cmake.log" 2>&1 ||
    { tail -n 30 "$root/cmake.log" >&2; exit 1; }
echo "building llama-server, llama-perplexity and llama-quantize with -j$jobs (log: $root/build.log)" >&2
cmake --build "$root/cmake" --target llama-server llama-perplexity llama-quantize -j "$jobs" \
    >"$root/build.log" 2>&1 || { tail -n 30 "$root/build.log" >&2; exit 1; }
mkdir -p "$root/bin"
cp "$root/cmake/bin/llama-server" "$binary"
cp "$root/cmake/bin/llama-perplexity" "$root/bin/llama-perplexity"
cp "$root/cmake/bin/llama-quantize" "$root/bin/llama-quantize"
echo "$binary"
