"""The decode stack's default thread count (kernels/cpu/topology.py, EngineConfig.native_threads):
one thread per physical core the process may run on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels.cpu import topology
from service.engine.config import EngineConfig
from service.engine.plan import native_threads


def _sysfs(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, listed in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(listed + "\n")
    return root


def test_hardware_threads_of_one_core_count_once(tmp_path: Path) -> None:
    # two cores with two hardware threads each, listed as Linux does (0,2 and 1,3)
    sysfs = _sysfs(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert topology.physical_cores({0, 1, 2, 3}, sysfs) == 2
    # an affinity of one thread of each core: two cores still
    assert topology.physical_cores({0, 1}, sysfs) == 2
    # both threads of one core: one
    assert topology.physical_cores({0, 2}, sysfs) == 1


def test_a_cpu_without_topology_counts_as_a_core(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0-1", 1: "0-1"})
    assert topology.physical_cores({0, 1, 5}, sysfs) == 2


def test_this_process_has_at_least_one_core_and_no_more_than_its_cpus() -> None:
    cpus = topology.usable_cpus()
    assert 1 <= topology.usable_physical_cores() <= len(cpus)


def test_decode_threads_default_to_the_physical_cores_and_are_capped_at_the_cpus() -> None:
    cpus = len(topology.usable_cpus())
    assert native_threads(EngineConfig().decode_threads) == topology.usable_physical_cores()
    assert native_threads(1) == 1
    assert native_threads(topology.MAX_THREADS) == min(cpus, topology.MAX_THREADS)


@pytest.mark.parametrize("threads", [-1, topology.MAX_THREADS + 1])
def test_decode_threads_outside_0_to_64_are_refused(threads: int) -> None:
    with pytest.raises(ValueError, match="decode_threads must be 0"):
        EngineConfig(decode_threads=threads)


def test_the_c_librarys_thread_limit_is_the_one_python_checks() -> None:
    header = Path(topology.__file__).with_name("src") / "pagechat_cpu.h"
    assert f"#define PC_MAX_THREADS {topology.MAX_THREADS}\n" in header.read_text()
