"""The docs name only what exists: every repository path they write in backticks, in a code
block or as a link, and every module they run with `python -m`, is in the tree. A file moved or
removed without its docs fails here, naming each reference left behind.

docs/perf-history.md is exempt: history names code as it was, removed code included. Outputs
(results/, build/, data/, /tmp) and URLs are not repository paths and are not read as such."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXEMPT = {"perf-history.md"}  # history may name removed code
PERF = ROOT / "docs" / "perf.md"
PERF_MAX_LINES = 300

# A path is read as the repository's when its first part is one of these folders (or it is one
# of the top-level files): results/, build/, data/ and /tmp are outputs, named freely.
SOURCE_FOLDERS = (
    "benchmarks",
    "clients",
    "deploy",
    "docs",
    "kernels",
    "loadtest",
    "protocol",
    "scripts",
    "service",
    "tests",
)
TOP_FILES = ("Makefile", "Dockerfile", "docker-compose.yml", "pyproject.toml", "README.md")

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
_FOLDERS = "|".join(SOURCE_FOLDERS)
_FILES = "|".join(re.escape(name) for name in TOP_FILES)
PATH = re.compile(rf"(?<![\w./-])((?:{_FOLDERS})/[\w./-]*|{_FILES})(?![\w-])")
MODULE = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")
LOCAL_PACKAGES = tuple(f for f in SOURCE_FOLDERS if (ROOT / f / "__init__.py").is_file())


def code_text(doc: str) -> list[str]:
    """The doc's code: each fenced block whole, and each backticked span outside them."""
    blocks = FENCE.findall(doc)
    return blocks + CODE_SPAN.findall(FENCE.sub("", doc))


def paths_in(code: str) -> set[str]:
    """Repository paths written in a piece of code, without trailing punctuation."""
    return {match.rstrip(".,:;") for match in PATH.findall(code)}


def modules_in(doc: str) -> set[str]:
    """Modules of this repository that the doc runs with `python -m`."""
    return {m.rstrip(".") for m in MODULE.findall(doc) if m.split(".")[0] in LOCAL_PACKAGES}


def links_in(doc: str) -> set[str]:
    """Markdown link targets that are files (no URL, no bare anchor), anchors cut off."""
    targets = set()
    for target in LINK.findall(doc):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        targets.add(target.split("#")[0])
    return targets


def module_exists(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def missing_references(doc_path: Path) -> list[str]:
    """Each path, link and module of one doc that is not in the tree, as `doc: reference`."""
    doc = doc_path.read_text()
    where = doc_path.relative_to(ROOT)
    missing = []
    for code in code_text(doc):
        missing += [f"{where}: {p}" for p in sorted(paths_in(code)) if not (ROOT / p).exists()]
    for target in sorted(links_in(doc)):
        if not (doc_path.parent / target).exists():
            missing += [f"{where}: link {target}"]
    missing += [f"{where}: python -m {m}" for m in sorted(modules_in(doc)) if not module_exists(m)]
    return sorted(set(missing))


@pytest.mark.parametrize(
    "doc_path", [d for d in DOCS if d.name not in EXEMPT], ids=lambda d: d.name
)
def test_every_path_and_module_the_docs_name_exists(doc_path: Path) -> None:
    missing = missing_references(doc_path)
    assert not missing, "the docs name what is not in the tree:\n" + "\n".join(missing)


def test_perf_page_stays_short() -> None:
    lines = len(PERF.read_text().splitlines())
    assert lines <= PERF_MAX_LINES, (
        f"docs/perf.md is {lines} lines (at most {PERF_MAX_LINES}): move superseded runs "
        "to docs/perf-history.md"
    )
