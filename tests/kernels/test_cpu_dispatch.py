"""The CPU kernel library's build (one file for every CPU of the architecture, cached by its
sources), the Docker image's recipe, and the choice of versions when a process starts: the
best this CPU runs, a forced one, and one kernel falling back alone."""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import build, dispatch, ops
from kernels.cpu.formats import WeightType, random_blocks
from kernels.cpu.library import library

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter; auto there means auto (whatever this run forces)."""
    base = {k: v for k, v in os.environ.items() if k != "PAGECHAT_CPU_ISA"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**base, **env}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.server
def test_the_library_is_built_once_into_the_cache_for_every_cpu_alike(tmp_path: Path) -> None:
    code = "from kernels.cpu.library import library; print(library() is not None)"
    for _ in range(2):
        out = _python(code, {"PAGECHAT_CACHE_DIR": str(tmp_path)})
        assert out.stdout.strip() == "True", out.stderr
    built = list(tmp_path.glob(f"libpagechat_cpu-{build.machine()}-*.so"))
    assert len(built) == 1  # the second start found the first one's library
    assert not [p for p in tmp_path.iterdir() if p not in built]  # no half-built leftovers
    # Nothing of this CPU goes into the file or its name: no -march=native, no CPU flags.
    commands = build.compile_commands("cc", build.machine(), tmp_path)
    assert not any("native" in flag for command in commands for flag in command)


@pytest.mark.server
def test_without_a_compiler_there_are_no_kernels_and_auto_serves_dense_weights(
    tmp_path: Path,
) -> None:
    code = (
        "from kernels.cpu import dispatch\n"
        "from service.engine.config import EngineConfig\n"
        "from service.engine.plan import plan_engine\n"
        "print(dispatch.select('auto'))\n"
        "plan = plan_engine(EngineConfig())\n"
        "print(plan.serve_stored, plan.kv_cache_for(plan.activation_dtype))\n"
        "try:\n    dispatch.select('generic')\nexcept ValueError as e:\n    print(e)\n"
    )
    out = _python(code, {"PAGECHAT_CACHE_DIR": str(tmp_path), "CC": str(tmp_path / "no-cc")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "None"
    assert lines[1].startswith("False torch.")  # dense weights, the activations' cache dtype
    assert "not available" in lines[2]
    assert "could not build the CPU kernels" in out.stderr


def _dockerfile_build_command() -> list[str]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(part for part in text.splitlines() if "kernels.cpu.build" in part)
    command = line.split("RUN", 1)[1].split("&&")[-1]
    return shlex.split(command)


@pytest.mark.server
def test_the_dockerfiles_library_picks_each_version_this_cpu_runs(tmp_path: Path) -> None:
    """The image's recipe (its RUN line, run here), then the image's start: the library from
    $PAGECHAT_CPU_LIB, no compiler, each version forced in turn and auto."""
    command = _dockerfile_build_command()
    assert command[:3] == ["python", "-m", "kernels.cpu.build"]
    output = tmp_path / "libpagechat_cpu.so"
    command[command.index("--output") + 1] = str(output)
    subprocess.run([sys.executable, *command[1:]], cwd=REPO, check=True, timeout=600)
    env = {
        "PAGECHAT_CPU_LIB": str(output),
        "CC": str(tmp_path / "no-cc"),
        "PAGECHAT_CACHE_DIR": str(tmp_path / "cache"),
    }
    runnable = [
        isa for isa in dispatch.names() if library() and library().pc_cpu_runs(isa.encode())
    ]
    for isa in ["auto", *runnable]:
        code = (
            "from kernels.cpu import dispatch\n"
            f"ks = dispatch.select({isa!r})\n"
            "print(sorted(set(ks.chosen.values())), ks.runnable)\n"
        )
        out = _python(code, env)
        assert out.returncode == 0, out.stderr
        want = runnable[-1] if isa == "auto" else isa
        assert out.stdout.split("]")[0] == f"[{want!r}", out.stdout
    assert not (tmp_path / "cache").exists()  # nothing was built at start-up


@pytest.fixture
def best(monkeypatch: pytest.MonkeyPatch) -> dispatch.KernelSet:
    """What auto picks where the environment names no version: the best this CPU runs."""
    monkeypatch.delenv("PAGECHAT_CPU_ISA", raising=False)
    best = dispatch.select("auto")
    assert best is not None
    return best


def test_every_kernel_runs_the_forced_version_and_auto_takes_the_best(
    best: dispatch.KernelSet,
) -> None:
    assert set(best.chosen) == set(dispatch.KERNELS)
    assert set(best.chosen.values()) == {best.runnable[-1]} and not best.fallbacks
    for isa in best.runnable:
        forced = dispatch.select(isa)
        assert forced is not None and set(forced.chosen.values()) == {isa}
        assert forced.describe() == isa


def test_a_version_this_cpu_cannot_run_or_that_does_not_exist_is_refused(
    best: dispatch.KernelSet,
) -> None:
    missing = [isa for isa in dispatch.names() if isa not in best.runnable]
    for isa in missing:
        with pytest.raises(ValueError, match="cannot run"):
            dispatch.select(isa)
    other_arch = "neon" if build.machine() == "x86_64" else "avx2"
    with pytest.raises(ValueError, match="unknown CPU kernel version"):
        dispatch.select(other_arch)


def test_auto_follows_the_environment_where_it_names_a_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGECHAT_CPU_ISA", "generic")
    chosen = dispatch.select("auto")
    assert chosen is not None and chosen.isa == "generic"
    assert dispatch.select("auto") is dispatch.select("generic")  # one probe per version


def test_a_kernel_that_disagrees_with_the_generic_one_falls_back_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    lib = library()
    assert lib is not None
    runnable = [isa for isa in dispatch.names() if lib.pc_cpu_runs(isa.encode())]
    if len(runnable) < 2:
        pytest.skip("this CPU runs only the generic version: there is nothing to fall back from")
    target = runnable[-1]

    def broken(version: dispatch.KernelSet, generic: dispatch.KernelSet) -> str | None:
        return "off by 1" if version.chosen["silu_mul"] == target else None

    monkeypatch.setitem(dispatch.PROBES, "silu_mul", broken)
    dispatch._select.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            chosen = dispatch.select(target)
    finally:
        dispatch._select.cache_clear()
    assert chosen is not None
    assert chosen.chosen["silu_mul"] == runnable[-2]  # the next version down
    assert {k: v for k, v in chosen.chosen.items() if k != "silu_mul"} == dict.fromkeys(
        [k for k in dispatch.KERNELS if k != "silu_mul"], target
    )
    assert chosen.describe() == f"{target} (silu_mul {runnable[-2]})"
    assert f"the {target} silu_mul kernel disagrees" in caplog.text
    assert chosen.fallbacks and "off by 1" in chosen.fallbacks[0]


def _split_product_in_a_child(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    kernels = dispatch.select("auto")
    assert kernels is not None
    gen = torch.Generator().manual_seed(5)
    weight = random_blocks(WeightType.Q8_0, 256, 64, gen)
    x = torch.randn(2, 64, generator=gen)
    split = ops.gemv_threads(kernels, [weight], x, 2)
    queue.put(torch.equal(split, ops.gemv(kernels, weight, x)))


@pytest.mark.server
def test_a_forked_child_starts_its_own_helper_thread() -> None:
    # The parent's helper is running (a split call); the child has none until it starts one.
    kernels = dispatch.select("auto")
    assert kernels is not None
    weight = random_blocks(WeightType.Q8_0, 256, 64, torch.Generator().manual_seed(1))
    ops.gemv_threads(kernels, [weight], torch.randn(1, 64), 2)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_split_product_in_a_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in the split call")
    assert child.exitcode == 0 and queue.get(timeout=5) is True


@pytest.mark.parametrize("arch", sorted(build.ISAS))
@pytest.mark.server
def test_every_version_compiles_without_a_warning(tmp_path: Path, arch: str) -> None:
    compiler = "cc" if arch == build.machine() else f"{arch}-linux-gnu-gcc"
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} (apt-get install gcc-{arch.replace('_', '-')}-linux-gnu)")
    commands = build.compile_commands(compiler, arch, tmp_path, build.WARNINGS)
    harness = [compiler, *build.COMMON_FLAGS, *build.WARNINGS, f"-I{build.SOURCE_DIR}", "-c",
               str(build.SOURCE_DIR / "harness.c"), "-o", str(tmp_path / "harness.o")]  # fmt: skip
    # Two at a time, as the library's own build (two cores; one at a time took twice as long).
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(
            lambda command: subprocess.run(command, capture_output=True, text=True, timeout=300),
            [*commands, harness],
        )
        for command, done in zip([*commands, harness], runs, strict=True):
            assert done.returncode == 0, f"{' '.join(command[-3:])}:\n{done.stderr[-3000:]}"
