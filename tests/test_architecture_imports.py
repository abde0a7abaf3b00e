"""The packages import each other in one direction only (DESIGN.md):
core <- checkpoint_io <- models <- data (data_pipelines/), eval <- train; and inside each package the modules import each other
without a cycle (function-level imports included: a cycle held apart by one is still a cycle)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("crate_clip", "data_pipelines", "eval")   # top-level folders; their sub-packages are checked too
# folder -> the import name it installs as (setup.cfg's package_dir)
INSTALLED_AS = {"data_pipelines": "crate_clip.data", "eval": "crate_clip.eval"}

# package -> top-level modules it must never import
FORBIDDEN = {
    # checkpoint and file I/O sit at the bottom: every other package may use them, they use none of ours
    "crate_clip/core": ("crate_clip.checkpoint_io", "crate_clip.train", "crate_clip.models", "crate_clip.data",
                        "crate_clip.eval", "crate_clip.cli", "crate_clip.convert_cli"),
    "crate_clip/checkpoint_io": ("crate_clip.train", "crate_clip.models", "crate_clip.data", "crate_clip.eval"),
    "crate_clip/models": ("crate_clip.train", "crate_clip.data", "crate_clip.eval", "crate_clip.cli"),
    "data_pipelines": ("crate_clip.train", "crate_clip.eval"),
    "eval": ("crate_clip.train", "crate_clip.data"),
}


def _dotted(parts: tuple) -> tuple:
    """A path's folder parts as the installed package's name parts (eval/tasks -> crate_clip.eval.tasks)."""
    if parts and parts[0] in INSTALLED_AS:
        return tuple(INSTALLED_AS[parts[0]].split(".")) + tuple(parts[1:])
    return tuple(parts)


def _imported_modules(path: Path, names: bool = False):
    """(line, module) of every import in the file, at any depth; relative imports resolved against the file's
    package. `names`: `module.name` for each name of a `from module import name` instead (it may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _dotted(path.relative_to(ROOT).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = ".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ())) \
                if node.level else node.module
            for target in ([f"{base}.{alias.name}" for alias in node.names] if names else [base]):
                yield node.lineno, target


def _violations(package: str, forbidden: tuple):
    for path in sorted((ROOT / package).rglob("*.py")):
        for lineno, module in _imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                yield f"{path.relative_to(ROOT)}:{lineno} imports {module}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package):
    assert (ROOT / package).is_dir()
    assert list(_violations(package, FORBIDDEN[package])) == []


def test_checker_sees_a_violation(tmp_path, monkeypatch):
    """The scan itself works: a planted forbidden import is reported."""
    bad = tmp_path / "pkg"
    bad.mkdir()
    (bad / "m.py").write_text("import os\nfrom crate_clip.eval.tasks.zeroshot import x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert list(_violations("pkg", ("crate_clip.eval",))) == ["pkg/m.py:2 imports crate_clip.eval.tasks.zeroshot"]


def _module_name(path: Path) -> str:
    parts = _dotted(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package (its own .py files, not sub-packages) that it imports."""
    files = {_module_name(p): p for p in sorted(package.glob("*.py"))}
    graph = {}
    for name, path in files.items():
        graph[name] = set()
        for _, target in _imported_modules(path, names=True):
            while target not in files and "." in target:   # `from m import f`: the module m (or the package's
                target = target.rsplit(".", 1)[0]            # __init__ for a name it exports)
            if target in files and target != name:
                graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of the graph as [a, b, ..., a], or [] when it has none (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def _packages() -> list[Path]:
    return sorted(init.parent for top in PACKAGES for init in (ROOT / top).rglob("__init__.py"))


@pytest.mark.parametrize("package", [str(p.relative_to(ROOT)) for p in _packages()])
def test_no_import_cycle_inside_a_package(package):
    graph = import_graph(ROOT / package)
    assert len(graph) > 1   # the scan found the package's modules
    assert find_cycle(graph) == []


def test_checker_sees_a_planted_cycle(tmp_path, monkeypatch):
    """The cycle scan works: two modules that import each other, one of them inside a function, are a cycle;
    the same imports in one direction are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import helper\n")
    (pkg / "b.py").write_text("import os\n\ndef helper():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("def helper():\n    return 1\n")
    assert find_cycle(import_graph(pkg)) == []
