"""docs/architecture.md's map matches the tree: its package table names every package, and
its module tree lists every module of `service/` and `kernels/`, each where it is, and
nothing that is not there. A module added, moved or removed without the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
MAPPED = ("service", "kernels")  # the tree covers these packages whole


def parts_section(doc: str) -> str:
    start = doc.index("## The parts")
    end = doc.index("\n## ", start + 1)
    return doc[start:end]


def package_table(section: str) -> list[str]:
    """The backticked names in the first column of the package table."""
    names: list[str] = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names += re.findall(r"`([^`]+)`", first)
    return names


def tree_entries(section: str) -> set[str]:
    """The paths the fenced tree names: files (`.py`) and folders (`/`), from indentation;
    wrapped description lines (no `.py` or `/` token first) are skipped."""
    block = section.split("```\n", 2)[1]
    entries: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for line in block.splitlines():
        stripped = line.lstrip(" ")
        if not stripped:
            continue
        name = stripped.split()[0]
        if not (name.endswith("/") or name.endswith(".py")):
            continue
        indent = len(line) - len(stripped)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + name
        if name.endswith("/"):
            stack.append((indent, path))
            entries.add(path.rstrip("/"))
        else:
            entries.add(path)
    return entries


def modules_on_disk() -> set[str]:
    """Every module (no `__init__.py`) and folder of MAPPED, as paths from the root; folders
    that hold no module (web/, src/) count as folders."""
    found: set[str] = set(MAPPED)
    for top in MAPPED:
        for path in (ROOT / top).rglob("*"):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            if path.is_dir():
                # Folders inside a mapped leaf (kernels/cpu/src's files) are the leaf's.
                if not any(parent.name in ("src", "web") for parent in rel.parents):
                    found.add(str(rel))
            elif path.suffix == ".py" and path.name != "__init__.py":
                found.add(str(rel))
    return found


@pytest.fixture(scope="module")
def section() -> str:
    return parts_section(DOC.read_text())


def test_the_module_tree_lists_every_module_where_it_is(section: str) -> None:
    listed = tree_entries(section)
    on_disk = modules_on_disk()
    assert not on_disk - listed, f"missing from docs/architecture.md: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"not in the tree: {sorted(listed - on_disk)}"


def test_the_package_table_names_every_package_and_only_real_ones(section: str) -> None:
    named = {name.rstrip("/") for name in package_table(section) if name.endswith("/")}
    # `service` is its packages (api, sessions, engine, server), each a row of its own.
    packages = {
        str(init.parent.relative_to(ROOT))
        for init in ROOT.glob("*/__init__.py")
        if init.parent.name not in ("tests", "service")
    }
    packages |= {str(init.parent.relative_to(ROOT)) for init in ROOT.glob("service/*/__init__.py")}
    assert not packages - named, f"packages the table leaves out: {sorted(packages - named)}"
    missing = {name for name in named if not (ROOT / name).is_dir()}
    assert not missing, f"the table names folders that do not exist: {sorted(missing)}"


def test_the_tree_reader_follows_indentation_and_skips_wrapped_lines() -> None:
    section = (
        "## The parts\n```\n"
        "pkg/\n"
        "  a.py         one\n"
        "  sub/\n"
        "    b.py       two, whose text\n"
        "               wraps onto a line\n"
        "  c.py         three\n"
        "other/x/\n"
        "  y.py\n"
        "```\n"
    )
    assert tree_entries(section) == {
        "pkg",
        "pkg/a.py",
        "pkg/sub",
        "pkg/sub/b.py",
        "pkg/c.py",
        "other/x",
        "other/x/y.py",
    }
