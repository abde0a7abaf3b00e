"""Every Python snippet of README.md and docs/ runs as written in an interpreter that has imported none of the project
(forked from one that imported the libraries alone: torch, torchvision, timm, open_clip, transformers; the project's
imports, open_clip's registration of its towers among them, are the snippet's own). A snippet's placeholders
are named in an HTML comment just above it (`<!-- snippet-test substitutes: A B -->`): the test replaces each
with a real stand-in made here (every named one must have one, and must occur in the snippet). A snippet that
cannot run here says why (`<!-- snippet-test skips: reason -->`) and is reported as a skip with that reason."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import warm_python
from train_fixtures import run_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- snippet-test (substitutes|skips): (.*?) -->\n)?```python\n(.*?)```", re.S)


def snippets() -> list:
    found = []
    for page in PAGES:
        for n, m in enumerate(BLOCK.finditer(page.read_text())):
            found.append(pytest.param(m.group(1), " ".join(m.group(2).split()) if m.group(2) else "", m.group(3),
                                      id=f"{page.relative_to(ROOT)}#{n}"))
    return found


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, fashion_mnist_dir) -> dict:
    """A real stand-in for each placeholder: a tiny CRATE-alpha CLIP export, a Fashion-MNIST PNG, small shards."""
    import open_clip
    from PIL import Image

    from crate_clip.data.sources.fashion_mnist import load_fashion_mnist
    from crate_clip.export.writer import export_open_clip
    from data_fixtures import write_numbered_shards

    root = tmp_path_factory.mktemp("snippets")
    model = open_clip.create_model("CRATE-alpha-CLIPA-tiny")
    export = export_open_clip(model.state_dict(), "CRATE-alpha-CLIPA-tiny", root / "export", image_size=28,
                              context_length=16)
    images, labels = load_fashion_mnist("test", fashion_mnist_dir)
    png = root / "ankle_boot.png"
    Image.fromarray(images[int(np.flatnonzero(labels == 9)[0])]).save(png)
    write_numbered_shards(root / "shards", 64, 32, fashion_mnist_dir)
    return {"runs/fashion_mnist_demo/export": str(export),
            "data/fashion_mnist/test/9_ankle_boot/000000.png": str(png),
            "/data/datacomp1b/shards/{00000000..00139827}.tar": str(root / "shards" / "{00000000..00000001}.tar"),
            "num_workers=8": "num_workers=1"}   # 2 cores here: one DataLoader worker still reads through one


@pytest.mark.parametrize("marker,words,code", snippets())
def test_doc_snippet_runs_as_written(marker, words, code, stand_ins, tmp_path):
    if marker == "skips":
        pytest.skip(words)
    for placeholder in words.split() if marker == "substitutes" else []:
        assert placeholder in stand_ins, f"no stand-in for the placeholder {placeholder!r}"
        assert placeholder in code, f"the placeholder {placeholder!r} is not in the snippet"
        code = code.replace(placeholder, stand_ins[placeholder])
    # forked from the interpreter that imported the libraries alone (torch, open_clip, ...; none of the project, which
    # the snippet imports itself), in the environment of the suite's commands (one thread)
    done = warm_python.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env=run_env(), base="libraries")
    assert done.returncode == 0, done.stderr[-3000:]


def test_image_statistics_are_open_clips():
    """crate_clip.core.image_normalization holds the numbers itself (no open_clip import at that layer)."""
    import open_clip.constants as c

    from crate_clip.core import image_normalization as ours

    assert (ours.OPENAI_MEAN, ours.OPENAI_STD) == (tuple(c.OPENAI_DATASET_MEAN), tuple(c.OPENAI_DATASET_STD))
    assert (ours.IMAGENET_MEAN, ours.IMAGENET_STD) == (tuple(c.IMAGENET_MEAN), tuple(c.IMAGENET_STD))


def test_stream_imports_first_in_a_fresh_interpreter():
    """`from crate_clip.data import build_train_stream` as a program's first import (docs/data.md's snippet)."""
    done = warm_python.run([sys.executable, "-c", "from crate_clip.data import StreamConfig, build_train_stream"],
                           capture_output=True, text=True, timeout=300, env=run_env(), base="libraries")
    assert done.returncode == 0, done.stderr[-2000:]
