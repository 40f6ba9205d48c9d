"""How many cores this process may compute on: the decode stack's default thread count.

A core's second hardware thread shares its load ports and vector units; the decode stack is
bound by memory reads and vector arithmetic, so a thread per hardware thread would only take
turns with its sibling (and spin while waiting for it). One thread per physical core the
process's CPU affinity lets it use, as llama.cpp's default does."""

from __future__ import annotations

import os
from pathlib import Path

SYSFS_CPUS = Path("/sys/devices/system/cpu")
MAX_THREADS = 64  # PC_MAX_THREADS (pagechat_cpu.h): a call's thread and its helpers


def usable_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity; every CPU off Linux)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], sysfs: Path = SYSFS_CPUS) -> int:
    """The physical cores among `cpus`: CPUs that are hardware threads of one core (the same
    `thread_siblings_list`) count once. A CPU whose topology sysfs does not show counts as a
    core of its own."""
    cores: set[str] = set()
    for cpu in cpus:
        siblings = sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(f"cpu{cpu}")
    return max(1, len(cores))


def usable_physical_cores() -> int:
    return physical_cores(usable_cpus())
