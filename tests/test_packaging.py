"""The two locks, pyproject.toml, the imports and the Dockerfile agree.

requirements.lock is the runtime (what `pagechat serve` needs, all the Docker image installs);
requirements-dev.lock is the rest of what tests and tools need. Requirements are followed
through the installed distributions' own metadata (this venv is built from both locks), so a
dependency a package gained or lost, a tool pinned in the runtime lock, or a module importing
an undeclared package fails here rather than in an image nobody built. The runtime lock in
use, in a fresh venv serving an answer, is scripts/check-runtime-lock.sh's to prove (minutes).
"""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.test_import_graph import imported_modules, modules_under, top_level

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
RUNTIME: list[str] = PYPROJECT["project"]["dependencies"]
DEV: list[str] = PYPROJECT["project"]["optional-dependencies"]["dev"]
SHIPPED = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
LOCAL = {*SHIPPED, "tests", "benchmarks", "loadtest", "deploy", "__future__"}


def lock(name: str) -> dict[str, str]:
    """A lock's pins: canonical distribution name -> version."""
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            dist, version = line.split("==")
            pins[canonicalize_name(dist)] = version
    return pins


def requires(requirements: Iterable[str]) -> set[str]:
    """The distributions `requirements` need, their own requirements followed all the way
    (markers evaluated for this interpreter, extras where a requirement names them)."""
    needed: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        needed.add(name)
        for text in importlib.metadata.distribution(name).requires or []:
            dep = Requirement(text)
            extras = {"", *req.extras}
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return needed


@cache
def distributions_of_modules() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def imported_distributions(packages: Iterable[str]) -> dict[str, set[str]]:
    """Distribution -> the modules of `packages` that import it (third-party imports only)."""
    found: dict[str, set[str]] = {}
    for package in packages:
        for path in modules_under(package):
            where = str(path.relative_to(ROOT))
            for module in {top_level(name) for name in imported_modules(path)}:
                if module in sys.stdlib_module_names or module in LOCAL:
                    continue
                for dist in distributions_of_modules().get(module, [f"<{module}: none>"]):
                    found.setdefault(canonicalize_name(dist), set()).add(where)
    return found


def names(requirements: Iterable[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_the_runtime_lock_is_exactly_what_the_runtime_dependencies_require() -> None:
    runtime_lock = set(lock("requirements.lock"))
    needed = requires(RUNTIME)
    assert not needed - runtime_lock, "missing from requirements.lock"
    assert not runtime_lock - needed, "not needed at run time: move to requirements-dev.lock"


def test_the_dev_lock_holds_the_rest_of_what_tests_and_tools_require() -> None:
    runtime_lock, dev_lock = set(lock("requirements.lock")), set(lock("requirements-dev.lock"))
    assert not runtime_lock & dev_lock, "pinned in both locks"
    rest = requires(DEV) - runtime_lock
    assert not rest - dev_lock, "missing from requirements-dev.lock"
    assert not dev_lock - rest, "required by nothing in the dev extra"


def test_every_pin_satisfies_pyproject_and_is_what_this_venv_runs() -> None:
    pins = lock("requirements.lock") | lock("requirements-dev.lock")
    for text in [*RUNTIME, *DEV]:
        req = Requirement(text)
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), text
    for name, version in pins.items():
        installed = Version(importlib.metadata.version(name))
        assert installed.public == version, f"{name}: the venv has {installed}, the lock {version}"


def test_the_shipped_packages_import_only_runtime_dependencies() -> None:
    declared = names(RUNTIME)
    imported = imported_distributions(SHIPPED)
    undeclared = {dist: paths for dist, paths in imported.items() if dist not in declared}
    assert not undeclared, "imported but not in pyproject's dependencies"
    assert {"torch", "starlette", "uvicorn", "websockets", "redis"} <= imported.keys()


def test_tests_and_tools_import_only_declared_dependencies() -> None:
    declared = names(RUNTIME) | names(DEV)
    imported = imported_distributions(["tests", "benchmarks", "loadtest", "deploy"])
    undeclared = {dist: paths for dist, paths in imported.items() if dist not in declared}
    assert not undeclared, "imported but in neither pyproject list"


# ---------------------------------------------------------------------- the image


def dockerfile_stages() -> dict[str, tuple[str, list[str]]]:
    """Stage name -> (the image it starts from, its instructions), continuation lines joined;
    the default target is the last stage, under the key ''."""
    stages: dict[str, tuple[str, list[str]]] = {}
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            words = line.split()
            current = []
            stage = (words[1], current)
            stages[words[3] if len(words) > 3 else f"stage{len(stages)}"] = stage
            stages[""] = stage
        else:
            current.append(line)
    return stages


def instructions_of(target: str) -> list[str]:
    """Every instruction that builds `target`, those of the stages it starts from first."""
    stages = dockerfile_stages()
    base, own = stages[target]
    return (instructions_of(base) if base in stages else []) + own


def test_the_runtime_image_installs_the_runtime_lock_and_copies_the_shipped_packages() -> None:
    runtime = instructions_of("")
    copies = [line.split()[1:-1] for line in runtime if line.startswith("COPY ")]
    copied = {src for words in copies if not words[0].startswith("--from=") for src in words}
    files = {"requirements.lock", "pyproject.toml"}
    assert copied == files | set(SHIPPED), "the runtime image copies more, or less"
    # From other stages, only the CPU kernel library built where a compiler is.
    built = [words for words in copies if words[0].startswith("--from=")]
    assert built == [["--from=native", "/src/libpagechat_cpu.so"]]
    installs = [line for line in runtime if line.startswith("RUN ") and "pip install" in line]
    assert any("-r requirements.lock" in line for line in installs)
    assert not any("dev" in line or "locust" in line for line in installs)


def test_compose_builds_replicas_from_the_runtime_image_and_locust_from_the_loadtest_one() -> None:
    loadtest = instructions_of("loadtest")
    assert "COPY loadtest ./loadtest" in loadtest
    assert any("locust" in line and "requirements-dev.lock" in line for line in loadtest)
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        target = service["build"]["target"] if isinstance(service["build"], dict) else ""
        uses_locust = "locust" in " ".join(service.get("command", []))
        assert target == ("loadtest" if uses_locust else ""), name
