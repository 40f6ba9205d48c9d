"""Kernel tests run Triton on the CPU through its interpreter.

Triton picks the interpreter when a `@triton.jit` decorator runs, so the variable must be set
before any kernel module is imported: this conftest is loaded before the test modules.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# The engine's fixtures (a tiny model, engines checked balanced after each test), for
# test_triton_backend.py: the whole engine on these kernels.
from tests.engine.conftest import make_engine, tiny_model, tiny_model_dir

__all__ = ["make_engine", "tiny_model", "tiny_model_dir"]
