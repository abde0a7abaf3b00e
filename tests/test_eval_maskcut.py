"""MaskCut on features with an obvious object, the segmentation CLI end to end, the composite-scene eval set."""
import json

import numpy as np
import pytest
from PIL import Image

from crate_clip.eval.maskcut import mask_iou, maskcut, normalized_cut


def _object_features(grid=(12, 12), box=(3, 8, 2, 7), seed=0, d=16):
    """Patch features: one direction inside the box, another outside, plus noise."""
    rng = np.random.default_rng(seed)
    truth = np.zeros(grid, bool)
    truth[box[0]:box[1], box[2]:box[3]] = True
    fg, bg = np.linalg.qr(rng.normal(size=(d, 2)))[0].T * 3  # orthogonal: cosine 0 < tau between the groups
    feats = np.where(truth.reshape(-1, 1), fg, bg) + 0.3 * rng.normal(size=(grid[0] * grid[1], d))
    return feats, truth


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_maskcut_finds_the_obvious_object(seed):
    feats, truth = _object_features(seed=seed)
    masks = maskcut(feats, (12, 12), tau=0.3, n_masks=3)
    assert masks and mask_iou(masks[0], truth) > 0.8
    # the flip rule: the background (touching all 4 corners) is never returned as the object
    assert not masks[0][0, 0] and not masks[0][-1, -1]


def test_maskcut_keeps_only_the_seed_component_and_finds_a_second_object():
    feats, truth = _object_features(box=(1, 5, 1, 5), seed=3)
    rng = np.random.default_rng(4)
    second = np.zeros((12, 12), bool)
    second[7:11, 6:11] = True
    other = np.linalg.qr(np.stack([*feats[[0, 20]], rng.normal(size=16)], axis=1))[0][:, 2] * 3
    feats[second.reshape(-1)] = other + 0.3 * rng.normal(size=(second.sum(), 16))
    first = normalized_cut(feats, (12, 12), 0.3)
    from scipy import ndimage
    assert ndimage.label(first)[1] == 1  # one connected component
    masks = maskcut(feats, (12, 12), tau=0.3, n_masks=3)
    ious = sorted(max(mask_iou(m, t) for m in masks) for t in (truth, second))
    assert ious[0] > 0.8


def test_maskcut_rejects_a_wrong_grid():
    with pytest.raises(ValueError, match="do not fill"):
        maskcut(np.zeros((10, 4)), (3, 3))


def test_composite_scenes_have_exact_silhouette_masks(fashion_mnist_dir):
    from pycocotools import mask as mask_utils
    from crate_clip.data.sources.composite_scenes import composite_scene_samples

    samples = list(composite_scene_samples(6, size=56, seed=1, source_dir=fashion_mnist_dir))
    counts = [len(s["extra"]["objects"]) for s in samples]
    assert all(1 <= c <= 3 for c in counts) and len(set(counts)) > 1
    for s in samples:
        img = np.asarray(s["image"])
        union = np.zeros((56, 56), bool)
        for obj in s["extra"]["objects"]:
            m = mask_utils.decode({**obj["segmentation"], "counts": obj["segmentation"]["counts"].encode()}) > 0
            assert m.sum() == obj["area"] and not (m & union).any()  # visible parts do not overlap
            union |= m
        assert img[~union].std() > 0.01  # a textured background, not a flat colour


@pytest.mark.slow
def test_segment_cli_writes_png_and_coco_json(tmp_path, fashion_mnist_dir):
    from crate_clip.cli import main
    from crate_clip.data.sources.composite_scenes import composite_scene_samples

    paths = []
    for i, s in enumerate(composite_scene_samples(2, size=56, seed=2, source_dir=fashion_mnist_dir)):
        paths.append(tmp_path / f"scene{i}.png")
        s["image"].save(paths[-1])
    out = tmp_path / "seg"
    rc = main(["segment", "--model", "CRATE-alpha-CLIPA-tiny", "--image-size", "56", "--images", *map(str, paths),
               "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "segments.json").read_text())
    assert [r["image"] for r in results] == [str(p) for p in paths]
    from pycocotools import mask as mask_utils
    for r in results:
        assert (r["height"], r["width"]) == (56, 56)
        for m in r["masks"]:
            assert mask_utils.decode({**m["segmentation"], "counts": m["segmentation"]["counts"].encode()}).shape == (56, 56)
        with Image.open(out / f"{r['stem']}_segments.png") as im:
            im.verify()
    rc = main(["inspect", "maps", "--model", "CRATE-alpha-CLIPA-tiny", "--image-size", "56", "--images",
               *map(str, paths), "--out", str(tmp_path / "maps"), "--layer", "1"])
    assert rc == 0
    names = sorted(p.name for p in (tmp_path / "maps").iterdir())
    assert names == ["scene0_attn_layer1.png", "scene0_attn_layer3.png", "scene0_pca.png",
                     "scene1_attn_layer1.png", "scene1_attn_layer3.png", "scene1_pca.png"]
    with Image.open(tmp_path / "maps" / "scene0_attn_layer3.png") as im:
        assert im.height == 56 * 3 and im.width == 6 * 56 * 3 + 5 * 2  # image, average, 4 heads (x3), 2 px gaps


def test_segment_and_maps_skip_unusable_images_with_one_line(tmp_path, fashion_mnist_dir, capsys):
    """A text file named .png, a 0-byte PNG and images smaller than the 7x7 patch grid are skipped and named in
    one line; the readable image is still segmented. Nothing usable at all is an error (exit 2)."""
    from crate_clip.cli import main
    from crate_clip.data.sources.fashion_mnist import load_fashion_mnist

    good = tmp_path / "good.png"
    Image.fromarray(load_fashion_mnist("test", fashion_mnist_dir)[0][0]).save(good)
    text, empty, dot, small = (tmp_path / n for n in ("text.png", "empty.png", "dot.png", "small.png"))
    text.write_text("not an image\n")
    empty.write_bytes(b"")
    Image.new("RGB", (1, 1)).save(dot)
    Image.new("RGB", (6, 30)).save(small)
    bad = [text, empty, dot, small]
    model = ["--model", "CRATE-alpha-CLIPA-tiny"]
    assert main(["segment", *model, "--images", str(good), *map(str, bad), "--out", str(tmp_path / "seg")]) == 0
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("crate-clip segment: skipped 4 of 5 images: ")
    assert all(str(p) in line for p in bad) and "unreadable: UnidentifiedImageError" in line
    assert "1x1 px, smaller than the model's 7x7 patch grid" in line and "6x30 px" in line
    assert json.loads(captured.out)["skipped"] == 4
    assert [r["image"] for r in json.loads((tmp_path / "seg" / "segments.json").read_text())] == [str(good)]
    assert main(["inspect", "maps", *model, "--images", str(good), str(dot), "--out", str(tmp_path / "maps")]) == 0
    captured = capsys.readouterr()
    assert "crate-clip inspect maps: skipped 1 of 2 images:" in captured.err and json.loads(captured.out)["images"] == 1
    assert main(["segment", *model, "--images", *map(str, bad), "--out", str(tmp_path / "none")]) == 2
    assert "none of the 4 images is usable" in capsys.readouterr().err
