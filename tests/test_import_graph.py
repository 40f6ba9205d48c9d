"""Import-graph seams: the wire protocol stands alone; the clients and the load tests speak it
without the server; the service's transports and sessions see the engine through its seam
only; no two modules of the service import each other, however indirectly.

Read from the source with an ast walk (imports under `TYPE_CHECKING` and inside functions
count too), so a seam broken in any module fails here, not when someone ships a client.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module `path` imports, absolute names, wherever in the file the import stands;
    for `from a import b`, `a` and `a.b` (b may be a module of package a)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base)
                module = f"{prefix}.{node.module}" if node.module else prefix
            elif node.module is not None:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def modules_under(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top_level(name: str) -> str:
    return name.split(".", 1)[0]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of `package` and the modules of `package` it imports. `from a import b`
    names module `a.b` when there is one, else `a`; a package's own `__init__` is left out,
    as importing a submodule runs it whatever the graph says."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    packages = {module_name(p, root) for p in paths.values() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = set()
        for imported in imported_modules(path, root):
            parts = imported.split(".")
            for end in range(len(parts), 0, -1):  # the longest prefix that is a module
                target = ".".join(parts[:end])
                if target in paths:
                    if target != name and target not in packages:
                        edges.add(target)
                    break
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a path (`a, b, a`), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if cycle := visit(node):
            return cycle
    return None


@pytest.mark.parametrize("path", modules_under("clients"), ids=lambda p: p.name)
def test_clients_do_not_import_the_server(path: Path) -> None:
    server = {name for name in imported_modules(path) if top_level(name) == "service"}
    assert not server, f"{path.relative_to(ROOT)} imports {sorted(server)}"


@pytest.mark.parametrize("path", modules_under("loadtest"), ids=lambda p: p.name)
def test_load_tests_do_not_import_the_server(path: Path) -> None:
    server = {name for name in imported_modules(path) if top_level(name) == "service"}
    assert not server, f"{path.relative_to(ROOT)} imports {sorted(server)}"


# What the transports and the sessions may import of the engine: its values, its interface and
# the sampling parameters a request carries. The engine's machinery (blocks, scheduler, runner,
# model, loader) is built and wired by the process alone (`service/server/`).
ENGINE_SEAM = {"service.engine.values", "service.engine.serving", "service.engine.params"}


@functools.cache
def service_graph() -> dict[str, set[str]]:
    """The service's import graph, read from the source once per run (the tree does not
    change under the suite), not once per module checked."""
    return import_graph("service")


def engine_imports(path: Path) -> set[str]:
    """The modules of service/engine (its third tier, service/engine/kvtier, included) `path`
    imports."""
    graph = service_graph()
    return {m for m in graph[module_name(path)] if m.startswith("service.engine.")}


@pytest.mark.parametrize(
    "path", modules_under("service/api") + modules_under("service/sessions"), ids=module_name
)
def test_the_service_sees_the_engine_only_through_its_seam(path: Path) -> None:
    beyond = engine_imports(path) - ENGINE_SEAM
    assert not beyond, f"{path.relative_to(ROOT)} imports engine internals {sorted(beyond)}"


@pytest.mark.parametrize("path", modules_under("service/engine"), ids=module_name)
def test_the_engine_imports_nothing_of_the_service_around_it(path: Path) -> None:
    outer = {
        name
        for name in imported_modules(path)
        if name.startswith(("service.api", "service.sessions", "service.server"))
    }
    assert not outer, f"{path.relative_to(ROOT)} imports {sorted(outer)}"


def test_the_engine_values_are_a_leaf() -> None:
    path = ROOT / "service/engine/values.py"
    allowed = set(sys.stdlib_module_names) | {"msgspec", "__future__"}
    outside = {name for name in imported_modules(path) if top_level(name) not in allowed}
    assert not outside, f"service/engine/values.py imports {sorted(outside)}"


@pytest.mark.parametrize("path", modules_under("protocol"), ids=lambda p: p.name)
def test_protocol_depends_on_msgspec_and_the_standard_library_only(path: Path) -> None:
    allowed = set(sys.stdlib_module_names) | {"msgspec", "protocol", "__future__"}
    outside = {name for name in imported_modules(path) if top_level(name) not in allowed}
    assert not outside, f"{path.relative_to(ROOT)} imports {sorted(outside)}"


def test_no_service_modules_import_each_other_in_a_circle() -> None:
    cycle = find_cycle(import_graph("service"))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_a_circle_through_a_type_checking_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("from pkg.c import C\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    (package / "d.py").write_text("import pkg.a\n")
    graph = import_graph("pkg", root=tmp_path)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg.a"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("")
    assert find_cycle(import_graph("pkg", root=tmp_path)) is None


def test_the_walk_finds_relative_and_type_checking_imports(tmp_path: Path) -> None:
    module = tmp_path / "a" / "b" / "c.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .x import y\n"
        "from .. import z\n"
        "if TYPE_CHECKING:\n"
        "    from service.server.hub import Hub\n"
        "def later() -> None:\n"
        "    import service.engine\n"
    )
    assert imported_modules(module, root=tmp_path) == {
        *("typing", "typing.TYPE_CHECKING"),
        *("a.b.x", "a.b.x.y"),
        *("a", "a.z"),
        *("service.server.hub", "service.server.hub.Hub"),
        "service.engine",
    }
