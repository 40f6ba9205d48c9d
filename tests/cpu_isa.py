"""Every CPU kernel version of this architecture as a test parameter: each test taking the
`cpu_isa` (its name) or `cpu` (every kernel at it) fixture runs once per version, and skips
only where this CPU cannot execute it (the suite's summary counts the runs per version:
tests/conftest.py)."""

from __future__ import annotations

import pytest

from kernels.cpu import dispatch
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.library import library


def versions() -> list[str]:
    return list(dispatch.names())


@pytest.fixture(params=versions())
def cpu_isa(request: pytest.FixtureRequest) -> str:
    """A version's name, where this CPU executes it."""
    lib = library()
    if lib is None:
        pytest.fail("the CPU kernel library did not build: the suite needs a C compiler")
    isa: str = request.param
    if not lib.pc_cpu_runs(isa.encode()):
        pytest.skip(f"this CPU cannot execute the {isa} kernels")
    request.node.user_properties.append(("cpu_isa", isa))
    return isa


@pytest.fixture
def cpu(cpu_isa: str) -> KernelSet:
    """Every kernel at one version, unprobed (what the probes themselves are checked by)."""
    lib = library()
    assert lib is not None
    return dispatch.uniform(lib, cpu_isa)
