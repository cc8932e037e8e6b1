"""The house in rooms: import direction, no import circles, rooms of a readable size.

The import direction api -> service -> trainer -> parallel, and the rooms' order inside trainer/ and
parallel/, are import-linter contracts (pyproject.toml). Those see every import, but not a circle
inside one layer; the graph walk here sees every import of every module, in functions too.
"""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "service", "trainer", "parallel")
MAX_MODULE_LINES = 400
MAX_MODULES_PER_FOLDER = 15
# Functions that fit on a screen, where the training road runs: the loop and its parts, the launcher, the engine.
MAX_FUNCTION_LINES = 60
SHORT_FUNCTIONS = ("trainer/run", "trainer/launch", "parallel/engine.py")
# An import inside a function says why, on its line or in the comments right above its import block:
# a measured start-up cost, or an optional dependency.
REASONS = ("start-up", "optional")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, ast.stmt, bool]]:
    """(imported project module, the statement, whether it sits inside a function) for every import."""
    tree = ast.parse(path.read_text())
    inside = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                  else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node, id(node) in inside))
    return found


def _comments_above(lines: list[str], index: int) -> list[str]:
    """The comment lines and imports right above line ``index`` (0-based): the block the reason is in."""
    above = []
    while index > 0 and lines[index - 1].strip().startswith(("#", "from ", "import ")):
        index -= 1
        above.append(lines[index])
    return above


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]], list[str]]:
    """(module -> modules it imports, folder -> folders it imports, in-function imports without a reason)."""
    modules = _modules()
    by_module: dict[str, set[str]] = defaultdict(set)
    by_folder: dict[str, set[str]] = defaultdict(set)
    unexplained = []
    for name, path in modules.items():
        lines = path.read_text().splitlines()
        folder = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target, node, in_function in _imports(name, path, modules):
            by_module[name].add(target)
            target_folder = target if modules[target].name == "__init__.py" else target.rpartition(".")[0]
            # A folder importing its own package's __init__ (a parent) is not a circle between rooms.
            if target_folder != folder and not folder.startswith(target_folder + "."):
                by_folder[folder].add(target_folder)
            said = " ".join([*_comments_above(lines, node.lineno - 1), *lines[node.lineno - 1: node.end_lineno]])
            if in_function and not any(reason in said for reason in REASONS):
                unexplained.append(f"{path.relative_to(REPO)}:{node.lineno} imports {target}")
    unexplained = sorted(set(unexplained))
    return by_module, by_folder, unexplained


def test_import_contracts_hold():
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                                                "lint_imports_command()"],
                         cwd=REPO, capture_output=True, text=True)
    assert "Contracts: 3 kept, 0 broken." in out.stdout, out.stdout + out.stderr


def test_no_import_circle_between_modules_or_folders():
    by_module, by_folder, _ = _graph()
    assert "trainer.validate.checks" in by_module["trainer.planner.auto.plan"]  # the walk sees imports
    assert _cycles(by_module) == []
    assert _cycles(by_folder) == []


def test_validation_never_imports_the_planner_search():
    by_module, _, _ = _graph()
    reached, todo = set(), ["trainer.validate.checks"]
    while todo:
        for target in by_module.get(todo.pop(), ()):
            if target not in reached:
                reached.add(target)
                todo.append(target)
    assert not {m for m in reached if m.startswith(("trainer.planner.auto", "trainer.planner.calibration"))}


def test_an_import_inside_a_function_says_why():
    _, _, unexplained = _graph()
    assert unexplained == []


def test_rooms_of_a_readable_size():
    modules = _modules()
    long = {name: n for name, path in modules.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
    per_folder = defaultdict(int)
    for path in modules.values():
        per_folder[path.parent.relative_to(REPO)] += path.name != "__init__.py"
    assert {str(folder): n for folder, n in per_folder.items() if n > MAX_MODULES_PER_FOLDER} == {}


def test_functions_of_the_loop_the_launcher_and_the_engine_fit_on_a_screen():
    """No function (method, nested function) in trainer/run/, trainer/launch/ or parallel/engine.py
    is longer than MAX_FUNCTION_LINES, decorators and docstring included."""
    paths = [path for where in SHORT_FUNCTIONS for path in sorted((REPO / where).rglob("*.py")
                                                                  if (REPO / where).is_dir()
                                                                   else [REPO / where])]
    assert len(paths) > 10 and REPO / "trainer" / "run" / "loop.py" in paths  # the walk finds the rooms
    long = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert long == {}


def test_parallel_does_not_import_trainer_or_mlflow():
    code = "import sys, parallel.engine, parallel.placements, parallel.plan.units; " \
           "print(sorted(m for m in sys.modules" \
           " if m.split('.')[0] in ('trainer', 'mlflow', 'fastapi', 'service', 'api')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
