"""The packages import each other in one direction only (DESIGN.md):
checkpoint_io <- models <- data_pipelines, eval <- train."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> top-level modules it must never import
FORBIDDEN = {
    # checkpoint and file I/O sit at the bottom: every other package may use them, they use none of ours
    "crate_clip/checkpoint_io": ("crate_clip.train", "crate_clip.models", "data_pipelines", "eval"),
    "crate_clip/models": ("crate_clip.train", "data_pipelines", "eval"),
    "data_pipelines": ("crate_clip.train", "eval"),
    "eval": ("crate_clip.train", "data_pipelines"),
}


def _imported_modules(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


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
    (bad / "m.py").write_text("import os\nfrom eval.zeroshot import x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert list(_violations("pkg", ("eval",))) == ["pkg/m.py:2 imports eval.zeroshot"]
