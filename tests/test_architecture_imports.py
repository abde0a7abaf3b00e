"""The packages import each other in one direction only (docs/layout.md, DESIGN.md): LAYERS, from the bottom up,
each importing only the layers below it; the top-level modules (crate_clip/*.py: the `crate-clip` command,
convert, the config-docs generator) are the top and nothing imports them; no cycle between the packages; and inside
each package the modules import each other without a cycle (function-level imports included: a cycle held apart by
one is still a cycle)."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("crate_clip", "data_pipelines", "eval")   # top-level folders; their sub-packages are checked too
# folder -> the import name it installs as (setup.cfg's package_dir)
INSTALLED_AS = {"data_pipelines": "crate_clip.data", "eval": "crate_clip.eval"}
TOP = "crate_clip/*.py"   # the top-level modules of crate_clip (its __init__ only registers the models)

# the layers from the bottom up: a package imports only packages of the layers below its own
LAYERS = (
    ("crate_clip/core",),             # errors, config-schema primitives, shard sources, class names, normalisation
    ("crate_clip/checkpoint_io",),    # checkpoint layout and reading, run folder layout, checksums, atomic files
    ("crate_clip/models",),           # towers, open_clip configs, CLIP build/load, the export's files and loading
    ("data_pipelines", "eval"),       # crate_clip.data, crate_clip.eval: neither imports the other
    ("crate_clip/export",),           # open_clip folders of checkpoints (model card: eval's summaries)
    ("crate_clip/train",),
    (TOP,),
)
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def _import_name(folder: str) -> str:
    parts = folder.split("/")
    return ".".join(_dotted(tuple(parts)))


def _top_modules() -> tuple:
    """crate_clip.cli, crate_clip.convert_cli, ...: the top-level modules, as found on disk."""
    return tuple(f"crate_clip.{p.stem}" for p in sorted((ROOT / "crate_clip").glob("*.py")) if p.stem != "__init__")


def forbidden_for(package: str) -> tuple:
    """The import names `package` must never import: its own layer's other packages and every layer above."""
    names = []
    for other, layer in LAYER_OF.items():
        if other != package and layer >= LAYER_OF[package]:
            names += _top_modules() if other == TOP else [_import_name(other)]
    return tuple(sorted(names))


def _dotted(parts: tuple) -> tuple:
    """A path's folder parts as the installed package's name parts (eval/tasks -> crate_clip.eval.tasks)."""
    if parts and parts[0] in INSTALLED_AS:
        return tuple(INSTALLED_AS[parts[0]].split(".")) + tuple(parts[1:])
    return tuple(parts)


FORBIDDEN = {package: forbidden_for(package) for package in LAYER_OF if package != TOP}


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


# ---------------------------------------------------------------- between the packages
def _layer_package(path: Path) -> str:
    """The LAYERS entry a file belongs to: its top-level package folder (eval/tasks -> eval), TOP for crate_clip/*.py."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] != "crate_clip":
        return rel.parts[0]
    return TOP if len(rel.parts) == 2 else f"crate_clip/{rel.parts[1]}"


def _package_of_import(module: str) -> str | None:
    """The LAYERS entry an imported module belongs to (None: not ours, or the bare `crate_clip`, whose __init__
    only imports the models)."""
    for folder, name in INSTALLED_AS.items():
        if module == name or module.startswith(name + "."):
            return folder
    parts = module.split(".")
    if parts[0] != "crate_clip" or len(parts) == 1:
        return None
    if (ROOT / "crate_clip" / parts[1]).is_dir():
        return f"crate_clip/{parts[1]}"
    return TOP if (ROOT / "crate_clip" / f"{parts[1]}.py").is_file() else None


def package_graph() -> dict[str, set[str]]:
    """LAYERS entry -> the LAYERS entries its files import (any depth, function-level imports included)."""
    graph = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            mine = _layer_package(path)
            graph.setdefault(mine, set())
            for _, module in _imported_modules(path):
                other = _package_of_import(module)
                if other is not None and other != mine:
                    graph[mine].add(other)
    return graph


def test_every_package_has_a_layer():
    """A new package is placed in LAYERS (and in docs/layout.md) before it is used."""
    assert set(package_graph()) == set(LAYER_OF)


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert len(graph) == len(LAYER_OF)
    assert find_cycle(graph) == []


def test_imports_run_down_the_layers():
    """Every arrow between two packages points to a lower layer (0 running back up)."""
    up = sorted(f"{a} -> {b}" for a, targets in package_graph().items() for b in targets if LAYER_OF[b] >= LAYER_OF[a])
    assert up == []


def test_package_scan_sees_a_planted_cycle(tmp_path, monkeypatch):
    """The package-level scan works: crate_clip/models importing crate_clip.eval makes a cycle with eval's use of the
    models, and an arrow running up."""
    for folder, text in {"crate_clip/models": "from crate_clip.eval.registry import TASKS\n",
                         "eval": "def f():\n    from crate_clip.models import create_clip\n",
                         "crate_clip/core": "import json\n"}.items():
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "m.py").write_text(text)
    (tmp_path / "data_pipelines").mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = package_graph()
    assert graph == {"crate_clip/models": {"eval"}, "eval": {"crate_clip/models"}, "crate_clip/core": set()}
    assert find_cycle(graph) == ["crate_clip/models", "eval", "crate_clip/models"]


# ---------------------------------------------------------------- docs/layout.md cannot drift
LAYOUT_DOC = ROOT / "docs" / "layout.md"


def layers_line() -> str:
    """docs/layout.md's line of the layers, as LAYERS says it."""
    return "layers: " + " < ".join(", ".join(f"`{p}`" for p in layer) for layer in LAYERS)


def _documented_folders(text: str) -> set[str]:
    """The folders the table's first column names (`eval/tasks/` -> eval/tasks)."""
    return {m.rstrip("/") for m in re.findall(r"^\| `([^`]+/)`", text, flags=re.MULTILINE)}


def test_layout_doc_states_the_layers():
    assert layers_line() in LAYOUT_DOC.read_text().splitlines()


def test_layout_doc_lists_exactly_the_packages():
    packages = {str(p.relative_to(ROOT)) for p in _packages()}
    documented = {f for f in _documented_folders(LAYOUT_DOC.read_text()) if f.split("/")[0] in PACKAGES}
    assert documented == packages


def test_layout_doc_checks_can_fail():
    assert _documented_folders("| `a/b/` | x |\n| `c/` (top) | y |\nno | `d/` |\n") == {"a/b", "c"}
    assert layers_line().startswith("layers: `crate_clip/core` < `crate_clip/checkpoint_io` < ")


# ---------------------------------------------------------------- inside crate_clip/train
TRAIN = ROOT / "crate_clip" / "train"
TRAIN_ENTRY = "*.py"   # crate_clip/train's own modules (cli, plan_cli, demo, worker_launch): the top, as TOP is above
# train's subpackages from the bottom up, each importing only the layers below its own (docs/layout.md)
TRAIN_LAYERS = (
    ("planning",),             # no torch: memory fit, micro-batch, FLOPs, wall time of a stage
    ("run", "reporting"),      # the run config, folder, lock and processes | the meter, metrics files, trackers
    ("stage_setup",),          # ResolvedStage and its model, the text lock, the optimizer, the DeepSpeed engine
    ("checkpointing",),        # checkpoints and their records, elastic resume, config changes on resume
    ("loop",),                 # the step, batch agreement, stop requests, stage evaluations, the stage loop and its parts
    (TRAIN_ENTRY,),
)
TRAIN_LAYER_OF = {part: i for i, layer in enumerate(TRAIN_LAYERS) for part in layer}


def _train_part(module: str) -> str | None:
    """The TRAIN_LAYERS entry of a dotted name under crate_clip.train (None: outside train, or train's __init__)."""
    parts = module.split(".")
    if parts[:2] != ["crate_clip", "train"] or len(parts) == 2:
        return None
    return parts[2] if (TRAIN / parts[2]).is_dir() else TRAIN_ENTRY


def train_part_graph() -> dict[str, set[str]]:
    """TRAIN_LAYERS entry -> the entries its files import (any depth; `from crate_clip.train import cli` counts)."""
    graph = {}
    for path in sorted(TRAIN.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(TRAIN).parts
        mine = rel[0] if len(rel) > 1 else TRAIN_ENTRY
        graph.setdefault(mine, set())
        for _, module in _imported_modules(path, names=True):
            other = _train_part(module)
            if other is not None and other != mine:
                graph[mine].add(other)
    return graph


def test_every_train_subpackage_has_a_layer():
    subpackages = {init.parent.name for init in TRAIN.glob("*/__init__.py")}
    assert subpackages | {TRAIN_ENTRY} == set(TRAIN_LAYER_OF)
    assert set(train_part_graph()) == set(TRAIN_LAYER_OF)


def test_train_imports_run_down_its_layers():
    """Inside crate_clip/train, every arrow between two subpackages points to a lower layer, and there is no cycle."""
    graph = train_part_graph()
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                if TRAIN_LAYER_OF[b] >= TRAIN_LAYER_OF[a])
    assert up == []
    assert find_cycle(graph) == []


def test_train_scan_sees_an_import_running_up(tmp_path, monkeypatch):
    """The train scan works: planning importing the loop (inside a function) is an arrow up and, with the loop's use
    of planning, a cycle."""
    for part, text in {"planning": "def f():\n    from crate_clip.train.loop.stage_loop import run_training\n",
                       "loop": "from crate_clip.train.planning import planner\n"}.items():
        (tmp_path / part).mkdir()
        (tmp_path / part / "__init__.py").write_text("")
        (tmp_path / part / "m.py").write_text(text)
    (tmp_path / "cli.py").write_text("from crate_clip.train import demo\n")
    monkeypatch.setattr(__import__(__name__), "TRAIN", tmp_path)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = train_part_graph()
    assert graph == {"planning": {"loop"}, "loop": {"planning"}, TRAIN_ENTRY: set()}
    assert find_cycle(graph) == ["loop", "planning", "loop"]


LOOP = ROOT / "crate_clip" / "train" / "loop"
PARTS_USER = "crate_clip.train.loop.stage_loop"   # the one module that composes the stage's parts


def parts_arrows(loop: Path) -> list[str]:
    """Imports that break the loop's one direction: a part importing the stage loop, or another module than the
    stage loop importing a part (the parts use the loop's building blocks; stage_loop.py alone puts them together)."""
    bad = []
    for path in sorted(loop.rglob("*.py")):
        in_parts = path.parent.name == "parts"
        for lineno, module in _imported_modules(path):
            if in_parts and module == PARTS_USER:
                bad.append(f"{path.name}:{lineno} imports {module}")
            if not in_parts and module.startswith("crate_clip.train.loop.parts") and path.stem != "stage_loop":
                bad.append(f"{path.name}:{lineno} imports {module}")
    return bad


def test_only_the_stage_loop_puts_the_parts_together(tmp_path, monkeypatch):
    assert parts_arrows(LOOP) == []
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "p.py").write_text("from crate_clip.train.loop.stage_loop import run_training\n")
    (tmp_path / "train_step.py").write_text("from crate_clip.train.loop.parts.stage_part import StagePart\n")
    assert parts_arrows(tmp_path) == ["p.py:1 imports crate_clip.train.loop.stage_loop",
                                      "train_step.py:1 imports crate_clip.train.loop.parts.stage_part"]


def train_layers_line() -> str:
    """docs/layout.md's line of train's layers, as TRAIN_LAYERS says it."""
    return "train layers: " + " < ".join(", ".join(f"`{p}`" for p in layer) for layer in TRAIN_LAYERS)


def test_layout_doc_states_the_train_layers():
    assert train_layers_line() in LAYOUT_DOC.read_text().splitlines()
