#!/usr/bin/env bash
# Everything a session lent a GPU should run, in one call (about 4 minutes on an H200):
#   device run: bash benchmarks/gpu_check.sh     (writes to $OUT, or ./gpu-check; PYTHON=python3)
# 1. benchmarks/kernels.py --sweep: correctness at full size, the decode table against SDPA,
#    host costs, prefill/mixed batches, cache ops, then ~55 launch configurations;
# 2. benchmarks/kernel_code.py: the same kernels' SASS as compiled by the card's Triton.
# Each part runs even if the one before failed; the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
py=${PYTHON:-python3}  # the GPU image has torch and triton in its python3
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    >"$out/gpu.txt" 2>&1 || true
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >>"$out/gpu.txt" 2>&1
"$py" -m benchmarks.kernels --sweep --out "$out/kernels.md" >"$out/kernels.log" 2>&1 || status=1
"$py" -m benchmarks.kernel_code --out "$out/code.md" >"$out/code.log" 2>&1 || status=1
tail -n 3 "$out/kernels.log" "$out/code.log"
exit "$status"
