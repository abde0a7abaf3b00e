"""Zero-shot never scores against the wrong class set: the data's own classnames.txt wins over the default data
set, and a `--dataset` (or class-names file) that disagrees with the data is refused naming both. One test per
layout: CLIP_benchmark wds/ shards, a PNG/JPEG class-folder set, and the ImageNet val folder."""
import json

import numpy as np
import pytest
from PIL import Image

from crate_clip.cli import main as crate_clip_main
from crate_clip.core.class_names import FASHION_MNIST_CLASSNAMES
from crate_clip.eval.class_sets import builtin_classnames, resolve_classnames
from crate_clip.eval.eval_datasets import imagenet_wnids


def _zeroshot(vit_file, data, *extra) -> list[str]:
    name, weights = vit_file
    return ["eval", "zeroshot", "--model", name, "--pretrained", str(weights), "--data", str(data),
            "--num-workers", "0", "--no-progress", "--cache-dir", "", *extra]


def _refusal(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err   # one line
    return err[0]


def test_own_classnames_win_over_the_default_and_a_disagreeing_choice_is_refused(tmp_path):
    data = tmp_path / "set" / "test"
    data.mkdir(parents=True)
    assert resolve_classnames(None, data) == list(builtin_classnames("imagenet1k"))   # nothing beside: default
    (tmp_path / "set" / "classnames.txt").write_text("\n".join(FASHION_MNIST_CLASSNAMES) + "\n")
    assert resolve_classnames(None, data) == list(FASHION_MNIST_CLASSNAMES)
    assert resolve_classnames("fashion_mnist", data) == list(FASHION_MNIST_CLASSNAMES)   # agrees: kept
    with pytest.raises(ValueError, match=r"dataset 'imagenet1k' \(1000 classes.*disagrees with .*classnames.txt "
                                         r"\(10 classes"):
        resolve_classnames("imagenet1k", data)
    swapped = tmp_path / "swapped.txt"   # same names, another label order: as wrong as another set
    swapped.write_text("\n".join(reversed(FASHION_MNIST_CLASSNAMES)) + "\n")
    with pytest.raises(ValueError, match="swapped.txt.*disagrees with"):
        resolve_classnames(None, data, swapped)


def test_wds_layout_uses_its_classnames_and_refuses_imagenet1k(vit_file, fashion_mnist_dir, tmp_path, capsys):
    """The issue's reproduction: `crate-clip eval zeroshot --data <wds folder>` without --dataset scored 1,000
    ImageNet names against a 10-class set (top-1 0.20%, exit 0)."""
    from crate_clip.data.cli import main as shards_main

    out = tmp_path / "fmnist_wds"
    assert shards_main(["eval-shards", "--out", str(out), "--max-images", "60", "--source-dir",
                        str(fashion_mnist_dir)]) == 0
    results = []
    for extra in ([], ["--dataset", "fashion_mnist"]):
        assert crate_clip_main(_zeroshot(vit_file, out, "--output", str(tmp_path / "r.json"), *extra)) == 0
        results.append(json.loads((tmp_path / "r.json").read_text()))
    assert results[0]["n_images"] == 60 and results[0]["top1"] > 0.25
    assert len(results[0]["per_class"]) == 10 and results[0]["per_class"] == results[1]["per_class"]
    capsys.readouterr()
    assert crate_clip_main(_zeroshot(vit_file, out, "--dataset", "imagenet1k")) == 2
    line = _refusal(capsys)
    assert "dataset 'imagenet1k' (1000 classes" in line and f"{out / 'classnames.txt'} (10 classes" in line


def test_class_folder_layout_uses_its_classnames_and_refuses_imagenet1k(sets, vit_file, tmp_path, capsys):
    assert crate_clip_main(_zeroshot(vit_file, sets["folder"], "--output", str(tmp_path / "r.json"))) == 0
    metrics = json.loads((tmp_path / "r.json").read_text())
    assert len(metrics["per_class"]) == 10 and metrics["top1"] > 0.25
    capsys.readouterr()
    assert crate_clip_main(_zeroshot(vit_file, sets["folder"], "--dataset", "imagenet1k")) == 2
    line = _refusal(capsys)
    assert "dataset 'imagenet1k' (1000 classes" in line and "classnames.txt (10 classes" in line


def test_imagenet_val_folder_defaults_to_imagenet1k_and_refuses_a_10_class_dataset(vit_file, tmp_path, capsys):
    val = tmp_path / "val"
    wnids = imagenet_wnids()
    for wnid in wnids:
        (val / wnid).mkdir(parents=True)
    image = Image.fromarray(np.full((28, 28, 3), 128, np.uint8))
    for wnid in wnids[:3]:
        image.save(val / wnid / "ILSVRC2012_val.png")
    output = tmp_path / "r.json"
    assert crate_clip_main(_zeroshot(vit_file, val, "--templates", "plain", "--output", str(output))) == 0
    metrics = json.loads(output.read_text())
    assert metrics["n_images"] == 3 and len(metrics["per_class"]) == 1000
    capsys.readouterr()
    assert crate_clip_main(_zeroshot(vit_file, val, "--dataset", "fashion_mnist")) == 2
    line = _refusal(capsys)
    assert "holds the 1,000 ImageNet-1K WordNet-id class folders but dataset 'fashion_mnist' has 10" in line
