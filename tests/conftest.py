"""Suite-wide setup: interpreter mode for Triton, one torch thread, shared model fixtures."""

from __future__ import annotations

import os

# Must be set before any @triton.jit runs: this machine has no GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(1)
