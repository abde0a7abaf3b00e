"""CLIP_benchmark, the independent evaluator, gives `crate-clip eval`'s zero-shot numbers on the same export,
shards and prompts, with the command docs/export.md shows run as written there (paths substituted). Runs where
CLIP_benchmark is installed (the `clip-benchmark` extra, in a venv of its own) and skips saying so elsewhere."""
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


def documented_command() -> list[str]:
    """The CLIP_benchmark command of docs/export.md's CLIP_benchmark section, as its words."""
    section = DOC.read_text().split("## CLIP_benchmark", 1)[1]
    block = re.search(r"# CLIP_benchmark, on the same shards and prompts\n(.*?)\n```", section, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


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
    assert words[0].endswith("/python") and "--output" in words
    paths = {"local-dir:runs/fashion_mnist_demo/export": f"local-dir:{export}", "data/fmnist_wds": str(data),
             "runs/fmnist_clip_benchmark.json": str(tmp_path / "cb.json")}
    cmd = [str(CB_PYTHON)] + [paths.get(w, w) for w in words[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)   # the checkout, as documented
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "cb.json").read_text())["metrics"]
    mine = json.loads(ours.read_text())
    assert mine["n_images"] == 200 and mine["top1"] > 0.25
    for cb_key, key in (("acc1", "top1"), ("acc5", "top5"), ("mean_per_class_recall", "mean_per_class")):
        assert abs(theirs[cb_key] - mine[key]) <= 1 / 200 + 1e-9, (cb_key, theirs[cb_key], mine[key])
