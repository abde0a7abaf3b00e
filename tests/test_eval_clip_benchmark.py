"""CLIP_benchmark, the independent evaluator, gives `crate-clip eval`'s zero-shot numbers on the same export,
prompts and images, the shards and the demo's image-folder layout, with the commands docs/export.md shows run as
written there (paths substituted). Runs where CLIP_benchmark is installed (the `clip-benchmark` extra, in a venv of
its own) and skips saying so elsewhere."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the venv `make clip-benchmark` makes (the command's own interpreter), else this one when it has CLIP_benchmark
CB_PYTHON = REPO / ".venv-clip-benchmark" / "bin" / "python"
if not CB_PYTHON.exists():
    pytest.importorskip("clip_benchmark", reason="CLIP_benchmark is not installed: it runs in a venv of its own "
                                                 "(make clip-benchmark, docs/export.md#clip_benchmark)")
    CB_PYTHON = Path(sys.executable)

from crate_clip.cli import main as crate_clip_main  # noqa: E402
from crate_clip.export.writer import export_open_clip  # noqa: E402

DOC = REPO / "docs" / "export.md"


def documented_command(comment: str = "# CLIP_benchmark, on the same shards and prompts") -> list[str]:
    """The command under `comment` in docs/export.md's CLIP_benchmark section (up to the next blank line or the
    block's end), as its words."""
    section = DOC.read_text().split("## CLIP_benchmark", 1)[1]
    block = re.search(re.escape(comment) + r"\n(.*?)\n(?:\n|```)", section, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


def run_documented(words: list[str], paths: dict) -> None:
    """The documented command from the checkout (as docs/export.md runs it) by CLIP_benchmark's interpreter, each
    path of `paths` replaced (inside a word too: the Python line names its output files)."""
    assert words[0] == ".venv-clip-benchmark/bin/python"
    cmd = [str(CB_PYTHON)]
    for word in words[1:]:
        for doc_path in sorted(paths, key=len, reverse=True):   # data/fashion_mnist/test before data/fashion_mnist
            word = word.replace(doc_path, paths[doc_path])
        cmd.append(word)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]


def test_clip_benchmark_gives_crate_clip_evals_numbers(vit, fashion_mnist_dir, tmp_path):
    from crate_clip.data.cli import main as shards_main

    model, name = vit
    export = export_open_clip(model.state_dict(), name, tmp_path / "export", image_size=28, context_length=16)
    data = tmp_path / "fmnist_wds"
    assert shards_main(["eval-shards", "--out", str(data), "--max-images", "200", "--source-dir",
                        str(fashion_mnist_dir)]) == 0
    ours = tmp_path / "crate_clip.json"
    assert crate_clip_main(["eval", "zeroshot", "--model", f"local-dir:{export}", "--data", str(data),
                            "--num-workers", "0", "--no-progress", "--cache-dir", "", "--output", str(ours)]) == 0
    words = documented_command()
    assert "--output" in words
    run_documented(words, {"runs/fashion_mnist_demo/export": str(export), "data/fmnist_wds": str(data),
                           "runs/fmnist_clip_benchmark.json": str(tmp_path / "cb.json")})
    theirs = json.loads((tmp_path / "cb.json").read_text())["metrics"]
    mine = json.loads(ours.read_text())
    assert mine["n_images"] == 200 and mine["top1"] > 0.25
    for cb_key, key in (("acc1", "top1"), ("acc5", "top5"), ("mean_per_class_recall", "mean_per_class")):
        assert abs(theirs[cb_key] - mine[key]) <= 1 / 200 + 1e-9, (cb_key, theirs[cb_key], mine[key])


def test_clip_benchmark_reads_the_demos_image_folder_as_documented(vit, fashion_mnist_dir, tmp_path):
    """docs/export.md's image-folder route: its JSON files written from the folder's classnames.txt, then
    CLIP_benchmark's `fer2013` ImageFolder over ROOT/test, scoring what `crate-clip eval` scores on the folder."""
    from crate_clip.data.sources.fashion_mnist import write_fashion_mnist_eval_folder

    model, name = vit
    export = export_open_clip(model.state_dict(), name, tmp_path / "export", image_size=28, context_length=16)
    folder = write_fashion_mnist_eval_folder(tmp_path / "fmnist" / "test", "test", fashion_mnist_dir, limit=200)
    ours = tmp_path / "crate_clip.json"
    assert crate_clip_main(["eval", "zeroshot", "--model", f"local-dir:{export}", "--data", str(folder),
                            "--dataset", "fashion_mnist", "--num-workers", "0", "--no-progress", "--cache-dir", "",
                            "--output", str(ours)]) == 0
    paths = {"runs/fashion_mnist_demo/export": str(export), "data/fashion_mnist/test": str(folder),
             "data/fashion_mnist": str(folder.parent), "runs/cb_classnames.json": str(tmp_path / "names.json"),
             "runs/cb_templates.json": str(tmp_path / "prompts.json"),
             "runs/fmnist_folder_clip_benchmark.json": str(tmp_path / "cb.json")}
    run_documented(documented_command("# CLIP_benchmark's class-name and prompt files for it, keyed by the "
                                      "--dataset name"), paths)
    assert json.loads((tmp_path / "names.json").read_text())["fer2013"][0] == "T-shirt/top"
    run_documented(documented_command("# CLIP_benchmark, on the same folder and prompts"), paths)
    theirs = json.loads((tmp_path / "cb.json").read_text())
    mine = json.loads(ours.read_text())
    assert theirs["dataset"] == "fer2013" and mine["n_images"] == 200 and mine["top1"] > 0.25
    for cb_key, key in (("acc1", "top1"), ("acc5", "top5"), ("mean_per_class_recall", "mean_per_class")):
        assert abs(theirs["metrics"][cb_key] - mine[key]) <= 1 / 200 + 1e-9, (cb_key, theirs["metrics"][cb_key])
