"""Kernel tests run Triton on the CPU through its interpreter.

Triton picks the interpreter when a `@triton.jit` decorator runs, so the variable must be set
before any kernel module is imported: this conftest is loaded before the test modules.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
