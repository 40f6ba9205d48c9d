"""Import-graph seams: the wire protocol stands alone; the clients speak it without the server.

Read from the source with an ast walk (imports under `TYPE_CHECKING` and inside functions
count too), so a seam broken in any module fails here, not when someone ships a client.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module `path` imports, absolute names, wherever in the file the import stands."""
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
                names.add(f"{prefix}.{node.module}" if node.module else prefix)
            elif node.module is not None:
                names.add(node.module)
    return names


def modules_under(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top_level(name: str) -> str:
    return name.split(".", 1)[0]


@pytest.mark.parametrize("path", modules_under("clients"), ids=lambda p: p.name)
def test_clients_do_not_import_the_server(path: Path) -> None:
    server = {name for name in imported_modules(path) if top_level(name) == "service"}
    assert not server, f"{path.relative_to(ROOT)} imports {sorted(server)}"


@pytest.mark.parametrize("path", modules_under("protocol"), ids=lambda p: p.name)
def test_protocol_depends_on_msgspec_and_the_standard_library_only(path: Path) -> None:
    allowed = set(sys.stdlib_module_names) | {"msgspec", "protocol", "__future__"}
    outside = {name for name in imported_modules(path) if top_level(name) not in allowed}
    assert not outside, f"{path.relative_to(ROOT)} imports {sorted(outside)}"


def test_the_walk_finds_relative_and_type_checking_imports(tmp_path: Path) -> None:
    module = tmp_path / "a" / "b" / "c.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .x import y\n"
        "from .. import z\n"
        "if TYPE_CHECKING:\n"
        "    from service.api.service import ChatService\n"
        "def later() -> None:\n"
        "    import service.engine\n"
    )
    assert imported_modules(module, root=tmp_path) == {
        "typing",
        "a.b.x",
        "a",
        "service.api.service",
        "service.engine",
    }
