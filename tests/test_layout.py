"""The house rules of ``minidist/`` (issue 18), checked on the source, so they stay true:

- no module imports or reads a private name (``_x``) of another module;
- no import cycle between modules (imports at a module's top level);
- no upward arrow: the engine (``minidist/*.py``, ``minidist.models``) imports no wing, a wing
  (``minidist.parallel``) imports neither serving, the course nor the command line, serving and the
  course not the command line (serving runs the wings' layouts, tensor-parallel decode, so it sits
  above them);
- a function's body (its docstring aside) is at most 60 lines unless a ``# long:`` comment in
  it says why;
- the reading list of ``minidist/__init__.py`` names every engine module and every wing;
- ``strategies/`` is gone: every way of splitting the work is one folder under ``parallel/``
  with its driver (``train.py``) inside.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minidist"
MAX_BODY_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(node: ast.AST, importer: str) -> list[str]:
    """The minidist modules an import statement loads (``from pkg import submodule`` counts
    the submodule, ``from module import name`` the module)."""
    found = []
    if isinstance(node, ast.Import):
        found += [a.name for a in node.names if a.name.startswith("minidist.")]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("minidist"):
        for alias in node.names:
            candidate = f"{node.module}.{alias.name}"
            found.append(candidate if candidate in MODULES else node.module)
    return [m for m in found if m in MODULES and m != importer]


def top_level_imports(tree: ast.Module):
    """Import statements run when the module loads (not those inside functions or classes)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    stack.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])


def private_crossings(sources: dict[str, str]) -> list[str]:
    """``module:line: what`` for each private name of another minidist module that a module's
    source (``sources``: module name -> its text) imports or reads."""
    problems = []
    for name, source in sources.items():
        tree = ast.parse(source)
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minidist"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        problems.append(f"{name}:{node.lineno}: from {node.module} import {alias.name}")
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("minidist"):
                        aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and aliases.get(node.value.id, "") in MODULES
                    and aliases[node.value.id] != name):
                problems.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    return problems


def test_no_private_name_crosses_modules():
    assert private_crossings({name: path.read_text() for name, path in MODULES.items()}) == []


def test_the_private_name_guard_sees_an_import_and_an_attribute():
    source = "from minidist.tensor import _state\nfrom minidist import tensor\nx = tensor._anomaly_threads\n"
    assert private_crossings({"minidist.probe": source}) == [
        "minidist.probe:1: from minidist.tensor import _state", "minidist.probe:3: tensor._anomaly_threads"]
    assert private_crossings({"minidist.tensor": "from minidist import tensor\nx = tensor._state\n"}) == []


def import_graph() -> dict[str, set[str]]:
    return {name: {m for node in top_level_imports(parse(path)) for m in imported_modules(node, name)}
            for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None (iterative DFS)."""
    state = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [], [(start, iter(sorted(graph[start])))]
        state[start] = 1
        path.append(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def layer(module: str) -> int:
    """0: the engine (minidist/*.py), 1: a wing (minidist.parallel...), 2: serving and the course, 3: the CLI."""
    for prefix, rank in (("minidist.cli", 3), ("minidist.course", 2), ("minidist.serving", 2),
                         ("minidist.parallel", 1)):
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return 0


def test_no_upward_arrow():
    upward = []
    for name, path in MODULES.items():
        if name in ("minidist", "minidist.__main__"):
            continue  # the package's face and `python -m minidist` sit above everything
        for node in ast.walk(parse(path)):
            for target in imported_modules(node, name) if isinstance(node, (ast.Import, ast.ImportFrom)) else ():
                if layer(target) > layer(name):
                    upward.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} imports {target}")
    assert upward == []


def long_functions() -> list[str]:
    found = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for node in ast.walk(parse(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = node.body[0]
            has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                isinstance(first.value.value, str)
            start = first.end_lineno + 1 if has_doc else first.lineno
            body = lines[start - 1:node.end_lineno]
            if len(body) > MAX_BODY_LINES and not any(re.match(r"\s*# long:", line) for line in body):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {len(body)} lines")
    return found


def test_functions_are_short_or_say_why():
    assert long_functions() == []


def test_the_reading_list_names_every_engine_module_and_wing():
    doc = ast.get_docstring(parse(PACKAGE / "__init__.py"))
    listed = set(re.findall(r"``([a-z0-9_.]+)``", doc))
    engine = {name.split(".", 1)[1] for name, path in MODULES.items()
              if path.parent == PACKAGE and path.stem not in ("__init__", "__main__")}
    wings = {f"parallel.{p.name}" for p in (PACKAGE / "parallel").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    assert engine - listed == set()
    assert wings - listed == set()


@pytest.mark.parametrize("wing", ["data_parallel", "parameter_server", "pipeline", "tensor_parallel", "zero", "fsdp",
                                  "three_d"])
def test_each_way_of_splitting_the_work_is_one_folder_with_its_driver(wing):
    folder = PACKAGE / "parallel" / wing
    assert (folder / "__init__.py").exists() and (folder / "train.py").exists()
    assert not (PACKAGE / "strategies").exists()


MAX_MODULE_LINES = 400


def test_a_module_over_400_lines_says_why():
    """Issue 30: a file a reader cannot hold is split along its ideas, or its docstring says why
    not in a paragraph that begins "Longer than 400 lines:"."""
    long = [f"{path.relative_to(ROOT)}: {count} lines" for path in MODULES.values()
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
            and "Longer than 400 lines:" not in (ast.get_docstring(parse(path)) or "")]
    assert long == []
